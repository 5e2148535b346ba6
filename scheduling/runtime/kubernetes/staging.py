"""Filling a team's data volume: one short-lived pod per input set (docs/decisions/0008).

The staging pod runs in the team's namespace, mounts the team's PVC read-write at the mount
path that replicas later mount read-only, and runs this module (`python -m
scheduling.runtime.kubernetes.staging --cache <mount> --result /dev/termination-log URI...`):
`scheduling.staging.stage` checks every input, fetches what the cache lacks, and the result
(each input's cache entry, size and sha256) goes back as the pod's termination message, which
the API server keeps in the pod's status. The platform reads it there, so it never mounts the
team's volume, and the paths it hands to replicas are already where replicas read them.

The pod is named after its input set: two jobs staging the same inputs follow one pod, and an
ended pod is replaced (a source may have changed since).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from scheduling.runtime.kubernetes.inventory import BERTH, MANAGED_BY
from scheduling.runtime.kubernetes.pods import (
    COMPONENT,
    NAME,
    TEAM,
    KubeSettings,
    _security,
    label_value,
    namespace_for,
)
from scheduling.runtime.kubernetes.volumes import claim_problem, writer_mount
from scheduling.staging import StagedInput, StagedInputs, StagingError, StagingProblem, stage

MAX_RESULT = 4096  # bytes of a termination message that the kubelet keeps
PROGRAM = "scheduling.runtime.kubernetes.staging"
CONTAINER = "stage"
_IMAGE_WAITS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
_GONE_RETRIES = 3  # a pod deleted under us is started again, this many times in all


class StagingPodFailed(RuntimeError):
    """The staging pod could not run or report (not the inputs' fault: StagingError is that);
    the message names the pod, what happened and the setting to check."""


class StagingPodGone(StagingPodFailed):
    """The pod was deleted before this task read its result: by another task that staged the
    same inputs and read it first, or by a person. Staging again is cheap (the volume's cache)."""


def staging_name(inputs: Sequence[str]) -> str:
    """The pod of an input set: the same inputs, in the same order, name the same pod."""
    digest = hashlib.sha256(json.dumps(list(inputs)).encode()).hexdigest()[:20]
    return f"berth-stage-{digest}"


def staging_pod_manifest(
    settings: KubeSettings, *, namespace: str, team: str, name: str, inputs: Sequence[str]
) -> dict[str, Any]:
    """The staging pod: the team's PVC read-write, Pod Security 'restricted', no API token,
    requests equal limits, and a deadline (`data_volume.staging_timeout_s`)."""
    volume = settings.data_volume
    if volume is None or volume.staging_image is None:
        raise ValueError(
            "data_volume.staging_image: staging on Kubernetes runs an image with Berth installed "
            "(docker/airflow); set data_volume.staging_image in the Kubernetes settings"
        )
    source, mount = writer_mount(volume, volume.claim_for(team))
    pod_security, container_security = _security(settings)
    if volume.fs_group is not None:
        pod_security = pod_security | {
            "fsGroup": volume.fs_group,
            "fsGroupChangePolicy": "OnRootMismatch",  # no recursive chown of a large cache
        }
    size = {"cpu": f"{round(volume.staging_cpus * 1000)}m",
            "memory": f"{round(volume.staging_memory_gb * 1024)}Mi"}  # fmt: skip
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": volume.staging_image,
        "command": [
            "python",
            "-m",
            PROGRAM,
            "--cache",
            volume.mount_path,
            "--result",
            "/dev/termination-log",
            "--",
            *inputs,
        ],
        "resources": {"requests": size, "limits": size},
        "securityContext": container_security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [mount],
    }
    if volume.staging_secret is not None:
        container["envFrom"] = [{"secretRef": {"name": volume.staging_secret}}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                MANAGED_BY: BERTH,
                NAME: "berth-staging",
                COMPONENT: "staging",
                TEAM: label_value(team),
            },
        },
        "spec": {
            "restartPolicy": "Never",
            "activeDeadlineSeconds": max(1, round(volume.staging_timeout_s)),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": pod_security,
            "containers": [container],
            "volumes": [source],
        },
    }


# ---- the result, through the termination message ------------------------------------------


def encode_result(staged: StagedInputs, cache: Path) -> str:
    """What the pod reports: per input its entry under the cache, kind, size, sha256, and
    whether it was fetched; compact, for the 4096 bytes a termination message holds."""
    rows = [
        [str(i.path.relative_to(cache)), i.kind, i.size, i.sha256, i.fetched] for i in staged.inputs
    ]
    return json.dumps({"staged": rows}, separators=(",", ":"))


def encode_problems(problems: Sequence[StagingProblem]) -> str:
    """The inputs' problems, each cut so that the whole fits a termination message."""
    room = max(80, (MAX_RESULT - 200) // max(1, len(problems)) - 20)
    rows = [[p.index, p.message[:room]] for p in problems]
    return json.dumps({"problems": rows}, separators=(",", ":"))[:MAX_RESULT]


def decode_result(message: str, inputs: Sequence[str], mount_path: str) -> StagedInputs:
    """The StagedInputs a pod reported, with paths where replicas read them (under the mount).
    Raises StagingError for the inputs' problems, StagingPodFailed for anything else."""
    try:
        data = json.loads(message)
    except ValueError:
        raise StagingPodFailed(f"it reported no result; its log ends: {message[-800:]!r}") from None
    if "problems" in data:
        raise StagingError([StagingProblem(i, inputs[i], text) for i, text in data["problems"]])
    rows = data.get("staged") or []
    if len(rows) != len(inputs):
        raise StagingPodFailed(f"it reported {len(rows)} inputs for {len(inputs)}")
    return StagedInputs(inputs=tuple(
        StagedInput(index=i, uri=inputs[i], path=str(PurePosixPath(mount_path, rel)), kind=kind,
                    key=PurePosixPath(rel).parent.name, size=size, sha256=sha, fetched=fetched)
        for i, (rel, kind, size, sha, fetched) in enumerate(rows)
    ))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The staging pod's program: stage the inputs into the cache, report to `--result`."""
    parser = argparse.ArgumentParser(prog=f"python -m {PROGRAM}", description=main.__doc__)
    parser.add_argument("--cache", type=Path, required=True, help="the data volume's mount")
    parser.add_argument("--result", type=Path, required=True, help="/dev/termination-log")
    parser.add_argument("inputs", nargs="+", help="file://, https:// or s3:// URIs")
    args = parser.parse_args(argv)
    try:
        staged = stage(args.inputs, args.cache, progress=_progress())
    except StagingError as e:
        print(e, file=sys.stderr)
        args.result.write_text(encode_problems(e.problems))
        return 2
    for i in staged.inputs:
        how = "fetched" if i.fetched else "already staged"
        print(f"{i.uri} -> {i.path} ({how}, {i.size} bytes, sha256 {i.sha256[:12]})")
    text = encode_result(staged, args.cache)
    if len(text.encode()) > MAX_RESULT:
        why = (f"the result of {len(staged.inputs)} inputs is longer than the {MAX_RESULT} bytes "
               "a pod can report; put the inputs under one folder (an s3:// prefix) and stage "
               "that instead")  # fmt: skip
        text = encode_problems([StagingProblem(0, args.inputs[0], why)])
        args.result.write_text(text)
        return 2
    args.result.write_text(text)
    return 0


def _progress() -> Callable[[str, int, int | None], None]:
    shown: dict[str, int] = {}

    def progress(uri: str, done: int, total: int | None) -> None:
        tenth = done * 10 // total if total else 0
        if total and tenth > shown.get(uri, -1):
            shown[uri] = tenth
            print(f"staging {uri}: {tenth * 10}% of {total / 1e6:.1f} MB", flush=True)

    return progress


# ---- the pod's life -------------------------------------------------------------------------


class Stager:
    """Runs staging pods in team namespaces and reads what they staged."""

    def __init__(
        self,
        core: client.CoreV1Api,
        settings: KubeSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.core, self.settings, self.clock, self.sleep = core, settings, clock, sleep

    def stage(self, team: str, inputs: Sequence[str], *, poll_s: float = 2.0) -> StagedInputs:
        """Stage `inputs` into the team's volume and return where replicas read them; waits
        for the pod (up to `data_volume.staging_timeout_s`), then deletes it."""
        if not inputs:
            return StagedInputs()
        for _ in range(_GONE_RETRIES):
            try:
                return self._stage_once(team, inputs, poll_s)
            except StagingPodGone as e:
                gone = e  # another stager of the same inputs read it first: stage again
        raise gone

    def _stage_once(self, team: str, inputs: Sequence[str], poll_s: float) -> StagedInputs:
        namespace, name = self.start(team, inputs)
        volume = self.settings.data_volume
        deadline = self.clock() + (volume.staging_timeout_s if volume else 0) + 60
        try:
            while (done := self.result(namespace, name, inputs)) is None:
                if self.clock() > deadline:
                    raise StagingPodFailed(f"staging pod {namespace}/{name} did not end in time")
                self.sleep(poll_s)
            return done
        finally:
            self._delete(namespace, name)

    def start(self, team: str, inputs: Sequence[str]) -> tuple[str, str]:
        """Create the input set's staging pod (or follow the one running); (namespace, name).
        ValueError naming the setting when staging cannot run here."""
        namespace, name = namespace_for(self.settings, team), staging_name(inputs)
        self.data_claim(namespace, team)
        body = staging_pod_manifest(
            self.settings, namespace=namespace, team=team, name=name, inputs=inputs
        )
        for _ in range(2):
            try:
                self.core.create_namespaced_pod(namespace, body)
                return namespace, name
            except ApiException as e:
                if e.status != 409:
                    raise
            pod = self._pod(namespace, name)
            if pod is not None and pod.status.phase in ("Pending", "Running"):
                return namespace, name  # another task stages the same inputs: follow it
            self._delete(namespace, name)  # ended: its result may be stale
        raise StagingPodFailed(f"staging pod {namespace}/{name} could not be replaced; retry")

    def data_claim(self, namespace: str, team: str) -> str:
        """The team's data volume, checked on the API server; ValueError naming the setting
        when it is not set, missing, or not ReadWriteMany."""
        volume = self.settings.data_volume
        if volume is None:
            raise ValueError(
                "data_volume: jobs with `inputs` need a data volume on Kubernetes; set "
                "data_volume in the Kubernetes settings (docs/decisions/0008)"
            )
        claim = volume.claim_for(team)
        try:
            pvc = self.core.read_namespaced_persistent_volume_claim(claim, namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            pvc = None
        problem = claim_problem(pvc, namespace, claim)
        if problem:
            raise ValueError(problem)
        return claim

    def result(self, namespace: str, name: str, inputs: Sequence[str]) -> StagedInputs | None:
        """What the pod staged once it ended, None while it runs; StagingError (the inputs'
        problems) or StagingPodFailed (the pod's)."""
        volume = self.settings.data_volume
        mount = volume.mount_path if volume else ""
        pod = self._pod(namespace, name)
        where = f"staging pod {namespace}/{name}"
        if pod is None:
            raise StagingPodGone(f"{where} is gone (deleted by someone else); stage again")
        statuses = pod.status.container_statuses or ()
        state = statuses[0].state if statuses else None
        if pod.status.phase in ("Pending", "Running"):
            waiting = state and state.waiting
            if waiting is not None and waiting.reason in _IMAGE_WAITS:
                raise StagingPodFailed(
                    f"{where} cannot pull its image ({waiting.reason}: {waiting.message}); fix "
                    "data_volume.staging_image in the Kubernetes settings"
                )
            return None
        term = state and state.terminated
        if pod.status.reason == "DeadlineExceeded":
            raise StagingPodFailed(
                f"{where} did not finish within data_volume.staging_timeout_s; raise it, or "
                "stage less at once"
            )
        if term is None:
            told = f"{pod.status.reason or pod.status.phase}: {pod.status.message or '-'}"
            raise StagingPodFailed(f"{where} ended without running ({told})")
        if term.reason == "OOMKilled":
            raise StagingPodFailed(f"{where} was OOMKilled; raise data_volume.staging_memory_gb")
        try:
            return decode_result(term.message or "", inputs, mount)
        except StagingPodFailed as e:
            raise StagingPodFailed(f"{where} exited with code {term.exit_code}: {e}") from None

    def _pod(self, namespace: str, name: str) -> Any | None:
        found = self.core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}")
        return found.items[0] if found.items else None

    def _delete(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except ApiException as e:
            if e.status != 404:
                raise


if __name__ == "__main__":
    sys.exit(main())
