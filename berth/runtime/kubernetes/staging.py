"""Filling a team's data volume: one short-lived pod per input set (docs/decisions/0008).

The staging pod runs in the team's namespace, mounts the team's PVC read-write at the mount
path that replicas later mount read-only, and runs this module (`python -m
berth.runtime.kubernetes.staging --cache <mount> --result /dev/termination-log URI...`):
`berth.staging.stage` checks every input, fetches what the cache lacks, and the result
(each input's cache entry, size and sha256) goes back as the pod's termination message, which
the API server keeps in the pod's status. The platform reads it there, so it never mounts the
team's volume, and the paths it hands to replicas are already where replicas read them.

The pod is named after its input set and the claim it writes: two jobs staging the same inputs
into the same volume follow one pod. A pod that succeeded within the last minute is followed
too (its result is fresh); an older or failed one is replaced (a source may have changed since).
Each task deletes only the pod it created or followed (by uid), never a newer one of the name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from berth.runtime.kubernetes.build_manifests import delete_exact
from berth.runtime.kubernetes.inventory import BERTH, MANAGED_BY
from berth.runtime.kubernetes.pods import (
    COMPONENT,
    NAME,
    TEAM,
    KubeSettings,
    _security,
    label_value,
    namespace_for,
)
from berth.runtime.kubernetes.volumes import DataVolume, claim_problem, writer_mount
from berth.staging import StagedInput, StagedInputs, StagingError, StagingProblem, stage

MAX_RESULT = 4096  # bytes of a termination message that the kubelet keeps
PROGRAM = "berth.runtime.kubernetes.staging"
CONTAINER = "stage"
_IMAGE_WAITS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
_MARGIN_S = 60.0  # beyond data_volume.staging_timeout_s: scheduling, image pull, our polling
# A succeeded pod this recent is followed, not replaced: its sources cannot have changed much
# since, and its followers may not have read it yet.
_FRESH = timedelta(seconds=60)


class StagingPodFailed(RuntimeError):
    """The staging pod could not run or report (not the inputs' fault: StagingError is that);
    the message names the pod, what happened and the setting to check."""


class StagingPodGone(StagingPodFailed):
    """The pod was deleted before this task read its result: by another task that staged the
    same inputs and read it first, or by a person. Staging again is cheap (the volume's cache)."""


def staging_name(
    inputs: Sequence[str], claim: str = DataVolume.model_fields["claim"].default
) -> str:
    """The pod of an input set written into `claim` (`DataVolume.claim_for(team)`): the same
    inputs, in the same order, into the same claim name the same pod. The claim is in the name
    because teams may share a namespace while each has its own claim."""
    key = json.dumps({"claim": claim, "inputs": list(inputs)}, sort_keys=True)
    return f"berth-stage-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


class StagingPod(NamedTuple):
    """One staging pod: `uid` tells it from a later pod of the same name."""

    namespace: str
    name: str
    uid: str


def staging_pod_manifest(
    settings: KubeSettings, *, namespace: str, team: str, name: str, inputs: Sequence[str]
) -> dict[str, Any]:
    """The staging pod: the team's PVC read-write, Pod Security 'restricted', no API token,
    requests equal limits, and a deadline (`data_volume.staging_timeout_s`)."""
    volume = _staging_volume(settings, "staging on Kubernetes")
    source, mount = writer_mount(volume, volume.claim_for(team))
    command = [
        "python", "-m", PROGRAM, "--cache", volume.mount_path,
        "--result", "/dev/termination-log", "--", *inputs,
    ]  # fmt: skip
    return one_shot_pod_manifest(
        settings, namespace=namespace, team=team, name=name, component="staging",
        command=command, volume=source, mount=mount,
    )  # fmt: skip


def _staging_volume(settings: KubeSettings, what: str) -> DataVolume:
    volume = settings.data_volume
    if volume is None or volume.staging_image is None:
        raise ValueError(
            f"data_volume.staging_image: {what} runs an image with Berth installed "
            "(docker/airflow); set data_volume.staging_image in the Kubernetes settings"
        )
    return volume


def one_shot_pod_manifest(
    settings: KubeSettings,
    *,
    namespace: str,
    team: str,
    name: str,
    component: str,
    command: Sequence[str],
    volume: dict[str, Any],
    mount: dict[str, Any],
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A pod that runs Berth's `command` once on a team's volume (staging, collecting):
    `data_volume`'s image, Secret, size, fsGroup and deadline; Pod Security 'restricted', no
    API token, requests equal limits, the result in its termination message; `env`: plain
    variables beside the Secret's."""
    data = _staging_volume(settings, f"{component} on Kubernetes")
    pod_security, container_security = _security(settings)
    if data.fs_group is not None:
        pod_security = pod_security | {
            "fsGroup": data.fs_group,
            "fsGroupChangePolicy": "OnRootMismatch",  # no recursive chown of a large cache
        }
    size = {"cpu": f"{round(data.staging_cpus * 1000)}m",
            "memory": f"{round(data.staging_memory_gb * 1024)}Mi"}  # fmt: skip
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": data.staging_image,
        "command": list(command),
        "resources": {"requests": size, "limits": size},
        "securityContext": container_security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [mount],
    }
    if data.staging_secret is not None:
        container["envFrom"] = [{"secretRef": {"name": data.staging_secret}}]
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in sorted(env.items())]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                MANAGED_BY: BERTH,
                NAME: f"berth-{component}",
                COMPONENT: component,
                TEAM: label_value(team),
            },
        },
        "spec": {
            "restartPolicy": "Never",
            "activeDeadlineSeconds": max(1, round(data.staging_timeout_s)),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": pod_security,
            "containers": [container],
            "volumes": [volume],
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
    rows = [[p.index, p.message[:room], p.transient] for p in problems]
    return json.dumps({"problems": rows}, separators=(",", ":"))[:MAX_RESULT]


def decode_result(message: str, inputs: Sequence[str], mount_path: str) -> StagedInputs:
    """The StagedInputs a pod reported, with paths where replicas read them (under the mount).
    Raises StagingError for the inputs' problems, StagingPodFailed for anything else."""
    try:
        data = json.loads(message)
    except ValueError:
        raise StagingPodFailed(f"it reported no result; its log ends: {message[-800:]!r}") from None
    if "problems" in data:
        raise StagingError(
            [StagingProblem(row[0], inputs[row[0]], row[1], *row[2:3]) for row in data["problems"]]
        )
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


class OneShotPods:
    """What runs one-shot pods in team namespaces needs: the API, the settings, a clock and a
    sleep (the tests' own), and reading a pod by name."""

    def __init__(
        self,
        core: client.CoreV1Api,
        settings: KubeSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.core, self.settings, self.clock, self.sleep = core, settings, clock, sleep

    def _pod(self, namespace: str, name: str) -> Any | None:
        found = self.core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}")
        return found.items[0] if found.items else None


class Stager(OneShotPods):
    """Runs staging pods in team namespaces and reads what they staged."""

    def stage(self, team: str, inputs: Sequence[str], *, poll_s: float = 2.0) -> StagedInputs:
        """Stage `inputs` into the team's volume and return where replicas read them; waits
        for the pod (up to `data_volume.staging_timeout_s`), then deletes it."""
        if not inputs:
            return StagedInputs()
        volume = self.settings.data_volume
        deadline = self.clock() + (volume.staging_timeout_s if volume else 0) + _MARGIN_S
        while True:
            try:
                return self._stage_once(team, inputs, poll_s, deadline)
            except StagingPodGone as e:
                # Another stager of the same inputs read it first: staging again is cheap
                # (the volume's cache), so every round until the deadline is worth it.
                if self.clock() > deadline:
                    raise StagingPodFailed(
                        "staging did not end within data_volume.staging_timeout_s: each time, "
                        f"the pod was deleted before this task read it (last: {e})"
                    ) from None
            self.sleep(poll_s)

    def _stage_once(
        self, team: str, inputs: Sequence[str], poll_s: float, deadline: float
    ) -> StagedInputs:
        pod = self.start(team, inputs)
        try:
            while (done := self.result(pod.namespace, pod.name, inputs)) is None:
                if self.clock() > deadline:
                    raise StagingPodFailed(
                        f"staging pod {pod.namespace}/{pod.name} did not end within "
                        "data_volume.staging_timeout_s; raise it, or stage less at once"
                    )
                self.sleep(poll_s)
            return done
        finally:
            self.delete(pod)

    def start(self, team: str, inputs: Sequence[str]) -> StagingPod:
        """Create the input set's staging pod, or follow the one running or just succeeded.
        ValueError naming the setting when staging cannot run here; StagingPodGone when
        other tasks replaced the pod meanwhile (start again)."""
        namespace = namespace_for(self.settings, team)
        name = staging_name(inputs, self.data_claim(namespace, team))
        body = staging_pod_manifest(
            self.settings, namespace=namespace, team=team, name=name, inputs=inputs
        )
        for _ in range(2):
            try:
                made = self.core.create_namespaced_pod(namespace, body)
                return StagingPod(namespace, name, made.metadata.uid)
            except ApiException as e:
                if e.status != 409:
                    raise
            pod = self._pod(namespace, name)
            if pod is None or pod.metadata.deletion_timestamp is not None:
                continue  # going already: create it again
            if _followable(pod, datetime.now(UTC)):
                return StagingPod(namespace, name, pod.metadata.uid)
            delete_exact(self.core.delete_namespaced_pod, name, namespace, pod.metadata.uid)
        raise StagingPodGone(
            f"staging pod {namespace}/{name} was replaced by other tasks as this one started it; "
            "stage again"
        )

    def delete(self, pod: StagingPod) -> None:
        """Delete this staging pod, if it is still there: never a newer one of the same name,
        which other tasks are waiting for."""
        delete_exact(self.core.delete_namespaced_pod, pod.name, pod.namespace, pod.uid)

    def data_claim(self, namespace: str, team: str) -> str:
        """The team's data volume, checked on the API server; ValueError naming the setting
        when it is not set, missing, or not ReadWriteMany."""
        volume = self.settings.data_volume
        if volume is None:
            raise ValueError(
                "data_volume: jobs with `inputs` need a data volume on Kubernetes; set "
                "data_volume in the Kubernetes settings (docs/decisions/0008)"
            )
        return self.checked_claim(namespace, volume.claim_for(team))

    def launch_claims(self, namespace: str, team: str, *, mount_data: bool) -> dict[str, str]:
        """The team's claims an attempt mounts (`new_launch`'s data_claim, checkpoint_claim
        and outputs_claim), each checked on the API server; ValueError naming the setting."""
        out, kube = {}, self.settings
        if mount_data:
            out["data_claim"] = self.data_claim(namespace, team)
        need = "the replicas of every attempt, on any node, write and read it"
        if kube.checkpoint_volume is not None:
            claim = kube.checkpoint_volume.claim_for(team)
            out["checkpoint_claim"] = self.checked_claim(
                namespace, claim, "checkpoint_volume.claim", need
            )
        if kube.outputs_volume is not None:
            claim = kube.outputs_volume.claim_for(team)
            out["outputs_claim"] = self.checked_claim(
                namespace, claim, "outputs_volume.claim", need
            )
        return out

    def checked_claim(self, namespace: str, claim: str, *problem_args: str) -> str:
        """`claim`, read on the API server; ValueError (`claim_problem`'s, with `problem_args`
        naming the setting and the need) when it is missing or not ReadWriteMany."""
        try:
            pvc = self.core.read_namespaced_persistent_volume_claim(claim, namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            pvc = None
        problem = claim_problem(pvc, namespace, claim, *problem_args)
        if problem:
            raise ValueError(problem)
        return claim

    def result(self, namespace: str, name: str, inputs: Sequence[str]) -> StagedInputs | None:
        """What the pod staged once it ended, None while it runs; StagingError (the inputs'
        problems) or StagingPodFailed (the pod's). Read by name: a newer pod of the name
        stages the same inputs into the same claim, so its result is as good."""
        volume = self.settings.data_volume
        mount = volume.mount_path if volume else ""
        pod = self._pod(namespace, name)
        where = f"staging pod {namespace}/{name}"
        if pod is None:
            raise StagingPodGone(f"{where} is gone (deleted by someone else); stage again")
        end = one_shot_end(pod, where, "stage less at once", StagingPodFailed)
        if end is None:
            return None
        exit_code, message = end
        try:
            return decode_result(message, inputs, mount)
        except StagingPodFailed as e:
            raise StagingPodFailed(f"{where} exited with code {exit_code}: {e}") from None


def one_shot_end(pod: Any, where: str, less: str, error: type[Exception]) -> tuple[int, str] | None:
    """(exit code, termination message) of a one-shot pod that runs `data_volume`'s image
    (staging, collecting) once it ended; None while it runs. `error`, naming the setting to
    fix, when it cannot pull its image, ran past its deadline (`less`: what else helps), was
    OOMKilled or ended without running."""
    statuses = pod.status.container_statuses or ()
    state = statuses[0].state if statuses else None
    if pod.status.phase in ("Pending", "Running"):
        waiting = state and state.waiting
        if waiting is not None and waiting.reason in _IMAGE_WAITS:
            raise error(
                f"{where} cannot pull its image ({waiting.reason}: {waiting.message}); fix "
                "data_volume.staging_image in the Kubernetes settings"
            )
        return None
    term = state and state.terminated
    if pod.status.reason == "DeadlineExceeded":
        raise error(
            f"{where} did not finish within data_volume.staging_timeout_s; raise it, or {less}"
        )
    if term is None:
        told = f"{pod.status.reason or pod.status.phase}: {pod.status.message or '-'}"
        raise error(f"{where} ended without running ({told})")
    if term.reason == "OOMKilled":
        raise error(f"{where} was OOMKilled; raise data_volume.staging_memory_gb")
    return term.exit_code, term.message or ""


def _followable(pod: Any, now: datetime) -> bool:
    """Whether a task may follow this pod of its input set instead of replacing it: it is
    running, or it succeeded within _FRESH (its result is as good as a new pod's, and the
    tasks that follow it may not have read it yet)."""
    phase = pod.status.phase if pod.status else None
    if phase in ("Pending", "Running"):
        return True
    statuses = (phase == "Succeeded" and pod.status.container_statuses) or ()
    term = statuses[0].state.terminated if statuses and statuses[0].state else None
    finished = term.finished_at if term else None
    return finished is not None and now - finished <= _FRESH


if __name__ == "__main__":
    sys.exit(main())
