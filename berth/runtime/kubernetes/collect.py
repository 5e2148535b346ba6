"""Artifacts out of a job's pods: one short-lived collector pod per job (docs/decisions/0025).

A finished pod's own filesystem cannot be read, so on Kubernetes an attempt works in its folder
of the team's `outputs_volume` (`training.py`), and after the run the collector pod mounts that
claim in the team's namespace and runs this module (`python -m
berth.runtime.kubernetes.collect`): for each attempt, `berth.staging.collect_artifacts` copies
the spec's artifact paths from `<sub_path>/<job>/<attempt>` to
`<artifacts_sub_path>/<job>/<attempt>` with its `manifest.json` (the same layout as
`$BERTH_HOME/artifacts` on the local runtime), and, given an S3 prefix, uploads them to
`<prefix>/<attempt>/` with `upload_artifacts` (credentials from `data_volume.staging_secret`),
and, given the attempt's MLflow run, logs them to it through the tracking server (proxied
artifacts: no storage credentials), as the embedded default does.
A summary per attempt comes back as the pod's termination message, as the staging pod's
result does; the manifests stay on the volume and in S3. The platform never mounts the team's
volume and never holds its S3 credentials for it.

An upload that fails is reported for its attempt, not raised: the copy on the volume is kept,
as on the local runtime, and the job's work is done.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, ConfigDict

from berth.runtime.kubernetes.build_manifests import delete_exact
from berth.runtime.kubernetes.pods import KubeSettings, job_name, namespace_for
from berth.runtime.kubernetes.staging import (
    MAX_RESULT,
    OneShotPods,
    Stager,
    one_shot_end,
    one_shot_pod_manifest,
)
from berth.runtime.kubernetes.training import OUTPUTS_VOLUME, OutputsVolume
from berth.staging.artifacts import ArtifactError, collect_artifacts, upload_artifacts

PROGRAM = "berth.runtime.kubernetes.collect"
_MARGIN_S = 60.0  # beyond data_volume.staging_timeout_s: scheduling, image pull, our polling
_SHOWN = 5  # missing patterns and skipped paths named per attempt; the manifest has them all


class CollectorFailed(RuntimeError):
    """The collector pod could not run or report; the message names the pod, what happened
    and the setting to check. The attempts' files are still on the team's volume."""


class CollectedAttempt(BaseModel):
    """What the collector did for one attempt (the full list is its `manifest.json`)."""

    model_config = ConfigDict(frozen=True)

    attempt: int
    present: bool  # the attempt's working directory existed (it ran on the outputs volume)
    files: int = 0
    bytes: int = 0
    missing: tuple[str, ...] = ()  # patterns that matched nothing (the first few)
    missing_count: int = 0
    skipped: tuple[str, ...] = ()  # 'path: reason' (the first few)
    skipped_count: int = 0
    dest: str = ""  # the copy and its manifest.json, relative to the claim's root
    s3_prefix: str | None = None  # where they went, when uploaded
    upload_error: str | None = None
    mlflow_run: str | None = None  # the attempt's run they were logged to
    mlflow_error: str | None = None


def collector_name(job_id: str) -> str:
    """The collector pod of a job: one per job, whatever its attempts."""
    return f"berth-collect-{hashlib.sha256(job_id.encode()).hexdigest()[:20]}"


def collector_pod_manifest(
    settings: KubeSettings,
    *,
    namespace: str,
    team: str,
    job_id: str,
    attempts: Sequence[int],
    patterns: Sequence[str],
    s3_prefix: str | None = None,
    mlflow_runs: Mapping[int, str] | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """The collector pod: the team's outputs claim read-write (it writes the copies), like a
    staging pod otherwise (`one_shot_pod_manifest`); `mlflow_runs`: attempt -> its run at
    `tracking_uri`, to log the copies to. ValueError naming the setting."""
    volume = _outputs(settings)
    source = {
        "name": OUTPUTS_VOLUME,
        "persistentVolumeClaim": {"claimName": volume.claim_for(team)},
    }
    mount = {"name": OUTPUTS_VOLUME, "mountPath": volume.mount_path}
    command = [
        "python", "-m", PROGRAM, "--root", volume.mount_path,
        "--work", f"{volume.sub_path}/{job_name(job_id)}",
        "--dest", f"{volume.artifacts_sub_path}/{job_name(job_id)}",
        "--attempts", ",".join(str(a) for a in attempts),
        "--result", "/dev/termination-log",
    ]  # fmt: skip
    if s3_prefix is not None:
        command += ["--s3-prefix", s3_prefix]
    env = {}
    if mlflow_runs and tracking_uri:
        for attempt, run_id in sorted(mlflow_runs.items()):
            command += ["--mlflow-run", f"{attempt}={run_id}"]
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return one_shot_pod_manifest(
        settings, namespace=namespace, team=team, name=collector_name(job_id),
        component="collector", command=[*command, "--", *patterns], volume=source, mount=mount,
        env=env,
    )  # fmt: skip


def _outputs(settings: KubeSettings) -> OutputsVolume:
    if settings.outputs_volume is None:
        raise ValueError(
            "outputs_volume: collecting artifacts on Kubernetes needs the attempts to work on a "
            "team volume; set outputs_volume in the Kubernetes settings (docs/decisions/0025)"
        )
    return settings.outputs_volume


# ---- the program, in the pod ----------------------------------------------------------------


def collect_attempt(
    root: Path,
    work: str,
    dest: str,
    attempt: int,
    patterns: Sequence[str],
    s3: str | None,
    mlflow_run: str | None = None,
) -> CollectedAttempt:
    """Collect one attempt's artifacts on the mounted claim (and upload them under
    `s3/<attempt>`, and log them to `mlflow_run` at MLFLOW_TRACKING_URI); its summary."""
    workdir = root / work / str(attempt)
    if not workdir.is_dir():
        return CollectedAttempt(attempt=attempt, present=False)
    got = collect_artifacts(workdir, patterns, root / dest / str(attempt))
    upload_error, prefix = None, None
    if s3 is not None:
        try:
            got = upload_artifacts(got, f"{s3.rstrip('/')}/{attempt}")
            prefix = got.s3_prefix
        except ArtifactError as e:
            upload_error = str(e)[:400]
    logged, mlflow_error = None, None
    if mlflow_run is not None and got.files:
        try:
            _log_to_mlflow(mlflow_run, root / dest / str(attempt))
            logged = mlflow_run
        except Exception as e:  # any client or network error: reported, the copies stay
            mlflow_error = f"{type(e).__name__}: {e}"[:400]
    return CollectedAttempt(
        attempt=attempt, present=True, files=len(got.files), bytes=got.total_bytes,
        missing=got.missing[:_SHOWN], missing_count=len(got.missing),
        skipped=tuple(f"{s.path}: {s.reason}"[:120] for s in got.skipped[:_SHOWN]),
        skipped_count=len(got.skipped), dest=f"{dest}/{attempt}", s3_prefix=prefix,
        upload_error=upload_error, mlflow_run=logged, mlflow_error=mlflow_error,
    )  # fmt: skip


def _log_to_mlflow(run_id: str, folder: Path) -> None:
    """The attempt's collected copy (with its manifest) into its run's artifacts, as the
    embedded default's collect does (`JobTracker.log_artifacts`)."""
    from mlflow import MlflowClient  # only here: importing mlflow costs about a second

    MlflowClient().log_artifacts(run_id, str(folder))


def encode_result(done: Sequence[CollectedAttempt]) -> str:
    """The summaries, made to fit the 4096 bytes of a termination message: first the names
    go (the manifests have them all), then the error texts, then the oldest attempts (the
    result says how many); every attempt kept keeps its counts and where its files went."""
    rows = [d.model_dump(exclude_defaults=True) for d in done]
    counts = ("attempt", "present", "files", "bytes", "missing_count", "skipped_count", "dest",
              "s3_prefix", "mlflow_run")  # fmt: skip
    steps = (
        lambda r: r,
        lambda r: (
            {k: v for k, v in r.items() if k in counts}
            | {k: r[k][:80] for k in ("upload_error", "mlflow_error") if k in r}
        ),
        lambda r: (
            {k: v for k, v in r.items() if k in counts}
            | {k: "failed" for k in ("upload_error", "mlflow_error") if k in r}
        ),
    )
    for step in steps:
        cut = [step(r) for r in rows]
        text = json.dumps({"collected": cut}, separators=(",", ":"))
        if len(text.encode()) <= MAX_RESULT:
            return text
    while cut:  # the oldest attempts go last: the newest is what a success is judged on
        dropped = len(rows) - len(cut) + 1
        cut = cut[1:]
        text = json.dumps({"collected": cut, "dropped": dropped}, separators=(",", ":"))
        if len(text.encode()) <= MAX_RESULT:
            return text
    return json.dumps({"collected": [], "dropped": len(rows)})


def decode_result(message: str) -> list[CollectedAttempt]:
    """The summaries a collector pod reported (the attempts it left out of its result are
    not in the list); CollectorFailed when it reported none."""
    try:
        rows = json.loads(message)["collected"]
        return [CollectedAttempt.model_validate(r) for r in rows]
    except (ValueError, KeyError, TypeError):
        raise CollectorFailed(f"it reported no result; its log ends: {message[-800:]!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The collector pod's program: collect each attempt's artifacts, report to `--result`."""
    parser = argparse.ArgumentParser(prog=f"python -m {PROGRAM}", description=main.__doc__)
    parser.add_argument("--root", type=Path, required=True, help="the outputs volume's mount")
    parser.add_argument("--work", required=True, help="the job's attempts, under the root")
    parser.add_argument("--dest", required=True, help="the job's collected copies, under it")
    parser.add_argument("--attempts", required=True, help="e.g. 1,2,3")
    parser.add_argument("--result", type=Path, required=True, help="/dev/termination-log")
    parser.add_argument("--s3-prefix", help="s3://bucket/prefix/<job>: uploads go under it")
    parser.add_argument(
        "--mlflow-run", action="append", default=[], help="ATTEMPT=RUN_ID: log its copy there"
    )
    parser.add_argument("patterns", nargs="+", help="the spec's artifact paths")
    args = parser.parse_args(argv)
    runs = {int(a): r for a, _, r in (x.partition("=") for x in args.mlflow_run)}
    done = []
    for attempt in (int(a) for a in args.attempts.split(",")):
        one = collect_attempt(
            args.root, args.work, args.dest, attempt, args.patterns, args.s3_prefix,
            runs.get(attempt),
        )  # fmt: skip
        where = f" -> {one.s3_prefix}" if one.s3_prefix else ""
        print(
            f"attempt {attempt}: "
            + (f"{one.files} file(s), {one.bytes} bytes -> {one.dest}{where}" if one.present
               else "no working directory (it did not run on the outputs volume)"),
            flush=True,
        )  # fmt: skip
        if one.upload_error:
            print(f"attempt {attempt}: not uploaded: {one.upload_error}", file=sys.stderr)
        if one.mlflow_error:
            print(f"attempt {attempt}: not logged to MLflow: {one.mlflow_error}", file=sys.stderr)
        done.append(one)
    args.result.write_text(encode_result(done))
    return 0


# ---- the pod's life -------------------------------------------------------------------------


class Collector(OneShotPods):
    """Runs a job's collector pod in its team's namespace and reads what it collected."""

    def collect(
        self,
        team: str,
        job_id: str,
        attempts: Sequence[int],
        patterns: Sequence[str],
        *,
        s3_prefix: str | None = None,
        mlflow_runs: Mapping[int, str] | None = None,
        tracking_uri: str | None = None,
        poll_s: float = 2.0,
    ) -> list[CollectedAttempt]:
        """Collect `attempts` of the job (its artifacts under `s3_prefix/<attempt>/` too, when
        given); waits for the pod (up to `data_volume.staging_timeout_s`), then deletes it.
        ValueError naming the setting when collecting cannot run here; CollectorFailed."""
        if not attempts or not patterns:
            return []
        namespace = namespace_for(self.settings, team)
        volume = _outputs(self.settings)
        Stager(self.core, self.settings).checked_claim(
            namespace, volume.claim_for(team), "outputs_volume.claim",
            "the collector pod reads what the replicas wrote on other nodes",
        )  # fmt: skip
        body = collector_pod_manifest(
            self.settings, namespace=namespace, team=team, job_id=job_id, attempts=attempts,
            patterns=patterns, s3_prefix=s3_prefix, mlflow_runs=mlflow_runs,
            tracking_uri=tracking_uri,
        )  # fmt: skip
        uid = self._create(namespace, body)
        name = body["metadata"]["name"]
        timeout = self.settings.data_volume.staging_timeout_s  # type: ignore[union-attr]
        deadline = self.clock() + timeout + _MARGIN_S
        try:
            while (done := self.result(namespace, name)) is None:
                if self.clock() > deadline:
                    raise CollectorFailed(
                        f"collector pod {namespace}/{name} did not end within "
                        "data_volume.staging_timeout_s; raise it, or collect less"
                    )
                self.sleep(poll_s)
            return done
        finally:
            delete_exact(self.core.delete_namespaced_pod, name, namespace, uid)

    def _create(self, namespace: str, body: dict[str, Any]) -> str:
        """Create the pod; one left by an earlier try of the same collection is replaced (a
        collection is idempotent: the same copies, uploads skipped where S3 has them)."""
        name = body["metadata"]["name"]
        for _ in range(2):
            try:
                return str(self.core.create_namespaced_pod(namespace, body).metadata.uid)
            except ApiException as e:
                if e.status != 409:
                    raise
            old = self._pod(namespace, name)
            if old is not None:
                delete_exact(self.core.delete_namespaced_pod, name, namespace, old.metadata.uid)
        raise CollectorFailed(
            f"collector pod {namespace}/{name} was recreated by someone else as this task "
            "started it; run the collect step again"
        )

    def result(self, namespace: str, name: str) -> list[CollectedAttempt] | None:
        """What the pod collected once it ended, None while it runs; CollectorFailed."""
        pod = self._pod(namespace, name)
        where = f"collector pod {namespace}/{name}"
        if pod is None:
            raise CollectorFailed(f"{where} is gone (deleted by someone else); collect again")
        end = one_shot_end(pod, where, "collect less", CollectorFailed)
        if end is None:
            return None
        exit_code, message = end
        try:
            return decode_result(message)
        except CollectorFailed as e:
            raise CollectorFailed(f"{where} exited with code {exit_code}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
