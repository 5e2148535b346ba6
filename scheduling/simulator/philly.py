"""Import the public Philly GPU-cluster trace into simulator inputs.

`berth trace import philly SRC --gpus N --out DIR` calls `import_philly`, which turns the
Philly CSV (`timestamp, duration, num_gpus, gpu_time, cluster`) into the three files the
simulator reads: `jobs.csv` (see `trace.py`), `teams.yaml` (one team per virtual cluster, with
nominal quotas proportional to its share of GPU-time) and `cluster.yaml` (N GPUs in 8-GPU nodes).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from scheduling.simulator.trace import REQUIRED_COLUMNS, TraceFormatError, TraceProblem

__all__ = [
    "PHILLY_COLUMNS",
    "PhillyFormatError",
    "PhillyImport",
    "PhillyImportError",
    "check_cluster_size",
    "cluster_yaml",
    "import_philly",
    "largest_remainder",
]

PHILLY_COLUMNS: tuple[str, ...] = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
_JOB_COLUMNS = (*REQUIRED_COLUMNS, "priority", "topology", "preemptible")
_PROGRESS_EVERY = 8192
_PLAIN_YAML = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class PhillyImportError(ValueError):
    """The import cannot proceed with the given options (cluster size, node size, gang split)."""


class PhillyFormatError(TraceFormatError):
    """The Philly source file is malformed; `.problems` lists every bad row and column."""


@dataclass(frozen=True, slots=True)
class PhillyImport:
    """What `import_philly` wrote: counts and the paths of the three output files."""

    jobs: int
    teams: int
    gangs: int
    clamped_durations: int
    jobs_path: Path
    teams_path: Path
    cluster_path: Path


@dataclass(frozen=True, slots=True)
class _Job:
    line: int
    submitted: datetime
    duration: float
    gpus: int
    gpu_time: float
    team: str


def import_philly(
    src: Path,
    gpus: int,
    out: Path,
    *,
    gpus_per_node: int = 8,
    show_progress: bool = True,
) -> PhillyImport:
    """Convert the Philly trace at `src` (a CSV file or a directory holding `philly.csv`).

    Writes `jobs.csv`, `teams.yaml` and `cluster.yaml` for a cluster of `gpus` GPUs into `out`.
    Jobs larger than one node become gangs of ceil(n / gpus_per_node) equal replicas; durations
    <= 0 are clamped to 1 s. Raises PhillyImportError for unusable options and
    PhillyFormatError for malformed source rows.
    """
    check_cluster_size(gpus, gpus_per_node)
    src = Path(src)
    if src.is_dir():
        src = src / "philly.csv"
    if not src.is_file():
        raise FileNotFoundError(f"Philly trace not found: {src} (pass the CSV or its directory)")

    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not show_progress,
    ) as progress:
        lines = src.read_text(encoding="utf-8-sig").splitlines()
        task = progress.add_task(f"reading {src.name}", total=max(len(lines) - 1, 0))
        jobs = _parse(src, lines, lambda n: progress.advance(task, n))

    splits = _gang_splits({j.gpus for j in jobs}, gpus_per_node)
    jobs.sort(key=lambda j: j.submitted)
    start = jobs[0].submitted

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jobs_path, teams_path, cluster_path = (
        out / "jobs.csv",
        out / "teams.yaml",
        out / "cluster.yaml",
    )
    gangs = clamped = 0
    with jobs_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(_JOB_COLUMNS)
        for i, job in enumerate(jobs, start=1):
            replicas, per_replica = splits[job.gpus]
            gangs += replicas > 1
            duration = job.duration
            if duration <= 0:
                duration, clamped = 1.0, clamped + 1
            writer.writerow(
                (
                    f"philly-{i:06d}",
                    _num((job.submitted - start).total_seconds()),
                    job.team,
                    replicas,
                    per_replica,
                    _num(duration),
                    0,
                    "any",
                    "true",
                )
            )

    totals: dict[str, float] = {}
    for job in jobs:
        totals[job.team] = totals.get(job.team, 0.0) + job.gpu_time
    teams = sorted(totals, key=lambda t: (-totals[t], t))
    nominal = largest_remainder([totals[t] for t in teams], gpus)
    teams_path.write_text(_teams_yaml(src.name, gpus, teams, nominal), encoding="utf-8")
    cluster_path.write_text(cluster_yaml(gpus, gpus_per_node), encoding="utf-8")
    return PhillyImport(
        jobs=len(jobs),
        teams=len(teams),
        gangs=gangs,
        clamped_durations=clamped,
        jobs_path=jobs_path,
        teams_path=teams_path,
        cluster_path=cluster_path,
    )


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Split `total` into whole parts proportional to `weights`, summing to exactly `total`.

    Each part gets the floor of its exact quota; the leftover units go to the largest
    remainders (ties to the earlier weight). All-zero weights split evenly.
    """
    if total < 0 or any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError("largest_remainder needs total >= 0 and finite weights >= 0")
    if not weights:
        return []
    exact = [Fraction(w) for w in weights]
    weight_sum = sum(exact)
    if weight_sum == 0:
        exact, weight_sum = [Fraction(1)] * len(weights), Fraction(len(weights))
    quotas = [q * total / weight_sum for q in exact]
    parts = [math.floor(q) for q in quotas]
    leftover = total - sum(parts)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (parts[i] - quotas[i], i))
    for i in by_remainder[:leftover]:
        parts[i] += 1
    return parts


def check_cluster_size(gpus: int, gpus_per_node: int) -> None:
    """Check that `gpus` GPUs make whole nodes of `gpus_per_node` GPUs each.

    The importer and `windows.philly_cluster` both build the cluster from these two numbers,
    so both check them here first. Raises PhillyImportError naming the option at fault (and,
    for `gpus`, a size that would do).
    """
    if gpus_per_node < 1:
        raise PhillyImportError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if gpus < gpus_per_node or gpus % gpus_per_node:
        raise PhillyImportError(
            f"--gpus must be a positive multiple of gpus_per_node={gpus_per_node} (whole nodes),"
            f" got {gpus}; try {max(1, round(gpus / gpus_per_node)) * gpus_per_node}"
        )


def _parse(src: Path, lines: list[str], advance: Callable[[int], None]) -> list[_Job]:
    """Parse the source rows, collecting every problem before raising."""
    reader = csv.reader(lines)
    header = [c.strip() for c in next(reader, [])]
    if not header:
        raise PhillyFormatError(src, [TraceProblem(1, "", "file is empty; expected a header")])
    missing = [c for c in PHILLY_COLUMNS if c not in header]
    if missing:
        problems = [
            TraceProblem(1, c, f"required Philly column is missing (expected {PHILLY_COLUMNS})")
            for c in missing
        ]
        raise PhillyFormatError(src, problems)
    ts_i, dur_i, n_i, gt_i, vc_i = (header.index(c) for c in PHILLY_COLUMNS)
    width = max(ts_i, dur_i, n_i, gt_i, vc_i) + 1
    jobs: list[_Job] = []
    problems: list[TraceProblem] = []
    count = 0
    for count, cells in enumerate(reader, start=1):
        if count % _PROGRESS_EVERY == 0:
            advance(_PROGRESS_EVERY)
        if not cells or not any(c.strip() for c in cells):
            continue
        line = reader.line_num
        if len(cells) < width:
            problems.append(
                TraceProblem(
                    line, "", f"row has {len(cells)} cells but the header has {len(header)}"
                )
            )
            continue
        before = len(problems)
        submitted = _timestamp(cells[ts_i], line, problems)
        duration = _number(cells[dur_i], line, "duration", problems)
        gpus = _gpus(cells[n_i], line, problems)
        gpu_time = _number(cells[gt_i], line, "gpu_time", problems)
        if gpu_time is not None and gpu_time < 0:
            problems.append(TraceProblem(line, "gpu_time", f"must be >= 0, got {cells[gt_i]}"))
        cluster = cells[vc_i].strip()
        if not cluster:
            problems.append(TraceProblem(line, "cluster", "is required but the cell is empty"))
        if len(problems) == before:
            assert submitted and duration is not None and gpus and gpu_time is not None
            jobs.append(_Job(line, submitted, duration, gpus, gpu_time, f"vc-{cluster}"))
    advance(count % _PROGRESS_EVERY)
    if problems:
        raise PhillyFormatError(src, problems)
    if not jobs:
        raise PhillyFormatError(src, [TraceProblem(1, "", "the file has no job rows")])
    return jobs


def _timestamp(cell: str, line: int, problems: list[TraceProblem]) -> datetime | None:
    try:
        value = datetime.fromisoformat(cell.strip())
    except ValueError:
        value = None
    if value is None or value.tzinfo is not None:
        problems.append(
            TraceProblem(line, "timestamp", f"must be YYYY-MM-DD HH:MM:SS, got {cell!r}")
        )
        return None
    return value


def _number(cell: str, line: int, column: str, problems: list[TraceProblem]) -> float | None:
    try:
        value = float(cell)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        problems.append(TraceProblem(line, column, f"must be a finite number, got {cell!r}"))
        return None
    return value


def _gpus(cell: str, line: int, problems: list[TraceProblem]) -> int | None:
    try:
        value = float(cell)
    except ValueError:
        value = math.nan
    if not (value.is_integer() and value >= 1):
        problems.append(
            TraceProblem(line, "num_gpus", f"must be a whole number >= 1, got {cell!r}")
        )
        return None
    return int(value)


def _gang_splits(sizes: Iterable[int], gpus_per_node: int) -> dict[int, tuple[int, int]]:
    """Map each job size to (replicas, gpus per replica); one node per replica at most."""
    splits: dict[int, tuple[int, int]] = {}
    bad: list[str] = []
    for n in sorted(sizes):
        replicas = math.ceil(n / gpus_per_node)
        if n % replicas:
            bad.append(f"{n} GPUs into {replicas} replicas")
        splits[n] = (replicas, n // replicas)
    if bad:
        raise PhillyImportError(
            f"with gpus_per_node={gpus_per_node} some jobs do not split into equal replicas"
            f" ({'; '.join(bad)}); pick a gpus_per_node that divides these job sizes evenly"
        )
    return splits


def _num(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def _yaml_str(value: str) -> str:
    return value if _PLAIN_YAML.fullmatch(value) else json.dumps(value)


def _teams_yaml(source: str, gpus: int, teams: list[str], nominal: list[int]) -> str:
    out = [
        f"# Generated by `berth trace import philly` from {source}.",
        f"# One team per Philly virtual cluster; the {gpus} GPUs are split as nominal quotas in",
        "# proportion to each team's total gpu_time in the trace (largest-remainder rounding,",
        f"# so the quotas sum to exactly {gpus}; a team with a tiny share may get 0). Weights 1.",
        "teams:",
    ]
    for team, k in zip(teams, nominal, strict=True):
        out += [f"  - name: {_yaml_str(team)}", f"    nominal: {{gpus: {k}}}", "    weight: 1"]
    return "\n".join(out) + "\n"


def cluster_yaml(gpus: int, gpus_per_node: int) -> str:
    """The `cluster.yaml` text the importer writes: `gpus` GPUs in nodes of `gpus_per_node`.

    V100 nodes of 64 CPUs and 512 GB, 8 nodes a rack and 4 racks a block, two NVLink islands a
    node when the node size is even. Shared with `windows.philly_cluster`, which parses it, so
    a replayed window runs on the very cluster the importer describes. Assumes
    `check_cluster_size(gpus, gpus_per_node)` passed.
    """
    if gpus_per_node % 2 == 0:
        groups, note = 2, f"two NVLink islands of {gpus_per_node // 2} GPUs"
    else:
        groups, note = 1, f"one NVLink island of {gpus_per_node} GPUs"
    return (
        f"name: philly-{gpus}\n"
        "topology_levels: [block, rack]\n"
        "slowdown: {gpu_group: 1.0, node: 1.1, rack: 1.3, block: 1.5, cluster: 1.8}\n"
        "node_pools:\n"
        "  - prefix: node\n"
        f"    count: {gpus // gpus_per_node}\n"
        f"    gpus: {gpus_per_node}\n"
        "    gpu_model: V100\n"
        f"    gpu_groups: {groups}          # {note}\n"
        "    cpus: 64\n"
        "    memory_gb: 512\n"
        "    nodes_per_rack: 8\n"
        "    racks_per_block: 4\n"
    )
