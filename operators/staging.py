"""Data in and out of a job, for the lifecycle tasks: `berth.staging` (content-addressed
input cache for file://, https:// and s3://; artifact collection with a manifest), logged to
the task log and returned as plain data for XCom.

Inputs are staged once per content under `$BERTH_HOME/data`; the replicas find them in
`BERTH_INPUT_<i>` (and `BERTH_INPUT_<NAME>` by file name). Artifacts are copied from each
attempt's working directory to `$BERTH_HOME/artifacts/<job>/<attempt>/`, failed attempts
included (a partial checkpoint or the metrics of a failed try is what on-call wants to read),
and, when the platform sets BERTH_ARTIFACTS_S3_PREFIX, to `<prefix>/<job>/<attempt>/` in S3
with their manifest. An upload that fails is a warning in the task log, never a failed job:
the job's work is done, and the local copy is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from berth.settings import settings
from berth.spec import JobSpec
from berth.staging import ArtifactError, ArtifactManifest, StagingError, stage
from berth.staging.artifacts import collect_artifacts, upload_artifacts

if TYPE_CHECKING:  # the kubernetes client loads only on the Kubernetes runtime
    from berth.runtime.kubernetes import KubernetesRuntime

__all__ = ["StagingError", "collect_attempt", "stage_inputs", "stage_on_cluster"]


def stage_inputs(
    inputs: Sequence[str], data_dir: Path, log: logging.Logger | None = None
) -> dict[str, str]:
    """Stage every input (raises StagingError naming `inputs[i]` before any download); returns
    the replicas' variables. Large transfers log their progress every tenth."""
    log = log or logging.getLogger(__name__)
    shown: dict[str, int] = {}

    def progress(uri: str, done: int, total: int | None) -> None:
        if not total:
            return
        tenth = done * 10 // total
        if tenth > shown.get(uri, -1):
            shown[uri] = tenth
            log.info("staging %s: %d%% of %.1f MB", uri, tenth * 10, total / 1e6)

    staged = stage(inputs, data_dir, progress=progress)
    for item in staged.inputs:
        how = "fetched" if item.fetched else "already staged"
        log.info(
            "%s -> %s (%s, %d bytes, sha256 %s)",
            item.uri,
            item.path,
            how,
            item.size,
            item.sha256[:12],
        )
    return staged.env()


def stage_on_cluster(
    runtime: KubernetesRuntime, spec: JobSpec, log: logging.Logger | None = None
) -> dict[str, str]:
    """Kubernetes: stage the job's inputs into its team's data volume with a staging pod (the
    same checks first, decision 0008); returns the replicas' variables, paths in the mount.
    StagingError for the inputs, ValueError for the settings, StagingPodFailed for the pod."""
    log = log or logging.getLogger(__name__)
    if not spec.inputs:
        return {}
    log.info("staging %d input(s) into team %s's data volume", len(spec.inputs), spec.team)
    staged = runtime.stage_inputs(spec.team, spec.inputs)
    for item in staged.inputs:
        log.info("%s -> %s (%d bytes, sha256 %s)", item.uri, item.path, item.size, item.sha256[:12])
    return staged.env()


def collect_attempt(
    artifacts: Sequence[str], workdir: Path, dest: Path, log: logging.Logger | None = None
) -> ArtifactManifest:
    """Copy one attempt's artifacts (missing ones are listed, not an error) to `dest`, which is
    `$BERTH_HOME/artifacts/<job>/<attempt>`, and from there to the platform's S3 prefix when
    BERTH_ARTIFACTS_S3_PREFIX is set (the same `<job>/<attempt>` under it). Returns the
    manifest, with the S3 locations when the upload went through."""
    log = log or logging.getLogger(__name__)
    got = collect_artifacts(workdir, artifacts, dest)
    log.info("artifacts: %d file(s), %d bytes -> %s", len(got.files), got.total_bytes, dest)
    if got.missing:
        log.warning("artifacts not written: %s", list(got.missing))
    s = settings()
    if s.artifacts_s3_prefix is None:
        return got
    try:  # the S3 copy mirrors the local tree: <prefix>/<job>/<attempt>/
        under = Path(dest).resolve().relative_to(s.artifacts_dir.resolve()).as_posix()
    except ValueError:
        under = "."
    if under == ".":
        log.warning(
            "artifacts: %s is not under %s, so it has no job and attempt to file it under in "
            "BERTH_ARTIFACTS_S3_PREFIX; not copied to S3",
            dest,
            s.artifacts_dir,
        )
        return got
    target = f"{s.artifacts_s3_prefix.rstrip('/')}/{under}"
    try:
        uploaded = upload_artifacts(got, target)
    except ArtifactError as e:
        log.warning("artifacts not copied to S3 (the job is not failed for it): %s", e)
        return got
    log.info("artifacts: %d file(s) and their manifest -> %s/", len(got.files), target)
    return uploaded
