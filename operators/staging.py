"""Data in and out of a job, for the lifecycle tasks: `scheduling.staging` (content-addressed
input cache for file://, https:// and s3://; artifact collection with a manifest), logged to
the task log and returned as plain data for XCom.

Inputs are staged once per content under `$BERTH_HOME/data`; the replicas find them in
`BERTH_INPUT_<i>` (and `BERTH_INPUT_<NAME>` by file name). Artifacts are copied from each
attempt's working directory to `$BERTH_HOME/artifacts/<job>/<attempt>/`, failed attempts
included (a partial checkpoint or the metrics of a failed try is what on-call wants to read).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from scheduling.staging import ArtifactManifest, StagingError, collect_artifacts, stage

__all__ = ["StagingError", "collect_attempt", "stage_inputs"]


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


def collect_attempt(
    artifacts: Sequence[str], workdir: Path, dest: Path, log: logging.Logger | None = None
) -> ArtifactManifest:
    """Copy one attempt's artifacts (missing ones are listed, not an error)."""
    log = log or logging.getLogger(__name__)
    got = collect_artifacts(workdir, artifacts, dest)
    log.info("artifacts: %d file(s), %d bytes -> %s", len(got.files), got.total_bytes, dest)
    if got.missing:
        log.warning("artifacts not written: %s", list(got.missing))
    return got
