"""Data staging and artifact collection for Berth jobs (no Airflow, no MLflow here).

`stage` makes a job's inputs (s3://, https://, file:// URIs) available in a content-addressed
cache before any GPU is requested: it checks every input first and reports every problem at
once, then fetches what the cache lacks, verified by size and sha256, one process per dataset.
`collect_artifacts` copies what a job wrote (after success or failure) and records a manifest
that MLflow logging reads. `prune` keeps the cache under a size limit.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from berth.staging.artifacts import ArtifactError, ArtifactFile, ArtifactManifest, Skipped
from berth.staging.artifacts import collect_artifacts as collect_artifacts
from berth.staging.cache import CacheError, ContentCache, Kind, PruneResult, prune
from berth.staging.sources import (
    ProgressCallback,
    S3Source,
    SourceProblem,
    Throttle,
    s3_endpoint_url,
    source_for,
)

__all__ = [
    "ArtifactError",
    "ArtifactFile",
    "ArtifactManifest",
    "ProgressCallback",
    "PruneResult",
    "Skipped",
    "StagedInput",
    "StagedInputs",
    "StagingError",
    "StagingProblem",
    "collect_artifacts",
    "prune",
    "rich_progress",
    "s3_endpoint_url",
    "stage",
]


@dataclass(frozen=True, slots=True)
class StagingProblem:
    """One input that cannot be staged: its index and URI, what is wrong and the fix."""

    index: int
    uri: str
    message: str
    transient: bool = False  # the source may answer next time: a retry can help

    def __str__(self) -> str:
        return f"inputs[{self.index}] {self.uri}: {self.message}"


class StagingError(Exception):
    """Inputs that cannot be staged; `problems` has them all, str() one per line."""

    def __init__(self, problems: Sequence[StagingProblem]) -> None:
        self.problems = list(problems)
        super().__init__(self.problems)

    def __str__(self) -> str:
        return "\n".join(map(str, self.problems))

    @property
    def transient(self) -> bool:
        """Whether a retry may stage them all: every problem is of the passing kind (one that
        needs a fix fails the job now, before it waits for the others)."""
        return bool(self.problems) and all(p.transient for p in self.problems)


class StagedInput(BaseModel):
    """Where a replica reads one input, and what the cache verified it holds."""

    model_config = ConfigDict(frozen=True)

    index: int
    uri: str
    path: Path  # a file, or a directory for a folder input (file:// directory, s3://.../)
    kind: Kind
    key: str
    size: int
    sha256: str  # of the file; of relative paths and contents for a directory
    fetched: bool  # False: the cache already held it and nothing was transferred


class StagedInputs(BaseModel):
    """The staged inputs, in the job spec's order; JSON-friendly for an Airflow XCom."""

    model_config = ConfigDict(frozen=True)

    inputs: tuple[StagedInput, ...] = ()

    @property
    def paths(self) -> list[Path]:
        return [i.path for i in self.inputs]

    def env(self) -> dict[str, str]:
        """Environment for the replicas: BERTH_INPUT_0 .. BERTH_INPUT_<n-1>, BERTH_INPUT_COUNT,
        and BERTH_INPUT_<NAME> per unambiguous basename (`train.csv` -> BERTH_INPUT_TRAIN_CSV).
        """
        out = {f"BERTH_INPUT_{i.index}": str(i.path) for i in self.inputs}
        out["BERTH_INPUT_COUNT"] = str(len(self.inputs))
        for name, path in self.by_name().items():
            var = "BERTH_INPUT_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()
            out.setdefault(var, str(path))  # never shadow an index variable
        return out

    def by_name(self) -> dict[str, Path]:
        """Path by basename, for basenames that only one input has (use the index otherwise)."""
        names: dict[str, list[Path]] = {}
        for i in self.inputs:
            names.setdefault(i.path.name, []).append(i.path)
        return {name: paths[0] for name, paths in names.items() if len(set(paths)) == 1}


def stage(
    inputs: Sequence[str],
    cache_dir: Path,
    *,
    progress: ProgressCallback | None = None,
    s3_endpoint_url: str | None = None,
    verify_cached: bool = True,
) -> StagedInputs:
    """Make every input available under `cache_dir`; the returned paths are what replicas read.

    First every input is checked (stat, HEAD, LIST) and all problems are raised together in a
    StagingError, before anything is downloaded (and so before any GPU is requested). Then each
    input is fetched unless the cache holds a valid entry for its content identity; concurrent
    stagers of the same content wait for one download. `verify_cached=False` trusts a cached
    entry whose size matches instead of re-hashing it (for inputs too large to read each time).
    The S3 endpoint is `s3_endpoint_url` when given, else BERTH_S3_ENDPOINT_URL or
    MLFLOW_S3_ENDPOINT_URL, else boto3's own.
    """
    if isinstance(inputs, str):
        raise TypeError(f"inputs must be a list of URIs, got the string {inputs!r}; write [uri]")
    cache = ContentCache(cache_dir)
    s3 = S3Source(s3_endpoint_url)
    checked, problems = [], []
    for index, uri in enumerate(inputs):
        try:
            source = source_for(uri, s3)
            checked.append((source, source.probe(uri)))
        except SourceProblem as e:
            problems.append(StagingProblem(index, uri, str(e), e.transient))
    if problems:
        raise StagingError(problems)

    staged = []
    scratch_root = cache.root / "tmp"
    scratch_root.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch_root) as scratch:
        for index, (source, probe) in enumerate(checked):
            throttle = Throttle(progress, probe.uri, probe.size)
            try:
                plan = source.plan(probe, Path(scratch), throttle)
                entry = cache.ensure(
                    plan.key,
                    probe.name,
                    plan.fill,
                    uri=probe.uri,
                    expected_size=plan.expected_size,
                    expected_sha256=plan.expected_sha256,
                    verify_cached=verify_cached,
                    extra={k: v for k, v in probe.details.items() if k != "listing"},
                )
            except SourceProblem as e:
                raise StagingError(
                    [StagingProblem(index, probe.uri, str(e), e.transient)]
                ) from None
            except CacheError as e:
                message = f"the content did not verify twice ({e}); check the source, and retry"
                raise StagingError([StagingProblem(index, probe.uri, message, True)]) from None
            except OSError as e:
                message = f"cannot write to the cache {cache.root} ({e}); free space or fix it"
                raise StagingError([StagingProblem(index, probe.uri, message)]) from None
            staged.append(
                StagedInput(
                    index=index,
                    uri=probe.uri,
                    path=entry.path,
                    kind=entry.kind,
                    key=entry.key,
                    size=entry.size,
                    sha256=entry.sha256,
                    fetched=entry.fetched,
                )
            )
    return StagedInputs(inputs=tuple(staged))


@contextmanager
def rich_progress(console: Console | None = None) -> Iterator[ProgressCallback]:
    """A progress callback for `stage` that draws one rich bar per input (CLI or task log).

    On a terminal the bars update live; in a log file rich prints the final state once.
    """
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bars:
        tasks = {}

        def update(uri: str, done: int, total: int | None) -> None:
            if uri not in tasks:
                tasks[uri] = bars.add_task(uri, total=total)
            bars.update(tasks[uri], completed=done, total=total)

        yield update
