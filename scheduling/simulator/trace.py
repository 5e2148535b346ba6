"""Load and validate a simulator trace (`jobs.csv`).

A trace is a CSV file with a header row and one job per row. Required columns:
`job_id, submit_time, team, replicas, gpus_per_replica, duration`; optional columns:
`priority, topology, preemptible, cpus_per_replica, memory_gb_per_replica, time_limit_s,
checkpoint_s, gpu_model, mixed_models` (an empty cell means the default). `time_limit_s` is
the most seconds one run may take: the simulator stops a run there, and only jobs with a
limit backfill reserved nodes. `checkpoint_s`: the job saves a checkpoint every so many
seconds of work, so a preemption loses only what it did since, and a checkpoint-aware policy
knows it. `gpu_model`: the GPU models the job accepts, in order of preference, separated by
`|`, e.g. `V100M16|V100M32` (empty: any); `mixed_models`: its replicas may run on different
models (by default a gang runs on one); `mig_profile`: each replica takes one MIG instance of
this profile (e.g. `1g.10gb`, scheduling/mig.py), and `gpus_per_replica` may be left empty: it
is the instance's compute share (1/7 of a GPU per slice, 0.143 for `1g.10gb`). Unknown
columns are ignored so traces can carry notes.

`load_trace` checks every row and reports every problem at once (line and column), because a
trace with many bad rows would otherwise take as many edit-and-rerun cycles to fix. Whether a
well-formed job can ever run on a given cluster is not checked here; the engine does that.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import SchemaValidator
from pydantic_core import core_schema as cs

from scheduling.cluster import TOPOLOGY_CHOICES
from scheduling.mig import profile_problem, share_of
from scheduling.resources import GPU_UNIT, gpu_request_problem

__all__ = [
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "TraceFormatError",
    "TraceJob",
    "TraceProblem",
    "load_trace",
]

REQUIRED_COLUMNS: tuple[str, ...] = (
    "job_id",
    "submit_time",
    "team",
    "replicas",
    "gpus_per_replica",
    "duration",
)
OPTIONAL_COLUMNS: tuple[str, ...] = (
    "priority",
    "topology",
    "preemptible",
    "cpus_per_replica",
    "memory_gb_per_replica",
    "time_limit_s",
    "checkpoint_s",
    "gpu_model",
    "mixed_models",
    "mig_profile",
)
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_MAX_LISTED = 50


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a trace; `duration` is the run time in seconds at the best placement."""

    job_id: str
    submit_time: float
    team: str
    replicas: int
    gpus_per_replica: float
    duration: float
    priority: int = 0
    topology: str = "any"
    preemptible: bool = True
    cpus_per_replica: float = 0.0
    memory_gb_per_replica: float = 0.0
    time_limit_s: float | None = None  # None: no limit
    checkpoint_s: float | None = None  # None: as the simulation says (by default never)
    gpu_model: str | None = None  # accepted GPU models, '|'-separated, preferred first; None: any
    mixed_models: bool = False  # its replicas may run on different models
    mig_profile: str | None = None  # one MIG instance of it per replica (scheduling/mig.py)

    @property
    def gpu_models(self) -> tuple[str, ...]:
        """The accepted GPU models, preferred first; empty: any."""
        return tuple(self.gpu_model.split("|")) if self.gpu_model else ()


@dataclass(frozen=True)
class TraceProblem:
    """One problem found in a trace file; `line` is 1-based and the header is line 1."""

    line: int
    column: str
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}, column {self.column}" if self.column else f"line {self.line}"
        return f"{where}: {self.message}"


class TraceFormatError(ValueError):
    """A trace file is malformed; `.problems` holds every problem found, in file order."""

    def __init__(self, path: Path | str, problems: list[TraceProblem]) -> None:
        self.path = Path(path)
        self.problems = list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        n = len(self.problems)
        lines = [f"{self.path}: {n} problem{'s' if n != 1 else ''} in trace"]
        lines += [f"  {p}" for p in self.problems[:_MAX_LISTED]]
        if n > _MAX_LISTED:
            lines.append(f"  ... and {n - _MAX_LISTED} more")
        return "\n".join(lines)


def _to_bool(value: Any) -> Any:
    if isinstance(value, str):
        parsed = _BOOLS.get(value.strip().lower())
        if parsed is None:
            raise ValueError(f"must be one of true/false/1/0/yes/no, got {value.strip()!r}")
        return parsed
    return value


def _to_topology(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _to_models(value: Any) -> Any:
    """'A100 | H100|A100' -> 'A100|H100' (stripped, each once); None when it names none."""
    if not isinstance(value, str):
        return value
    models = list(dict.fromkeys(m.strip() for m in value.split("|") if m.strip()))
    return "|".join(models) or None


def _check_profile(value: str) -> str:
    problem = profile_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _check_gpus(value: float) -> float:
    problem = gpu_request_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _row_validator() -> SchemaValidator:
    """The pydantic v2 row model: one CSV row (a dict of non-empty cells) -> one TraceJob.

    It is written as a pydantic-core schema rather than a BaseModel so that pydantic builds the
    frozen TraceJob itself; a BaseModel plus a copy into TraceJob made the full Philly trace
    (82k rows) load about 1.5x slower.
    """
    text = cs.str_schema(min_length=1, strip_whitespace=True)

    def number(**bounds: float) -> cs.CoreSchema:
        return cs.float_schema(allow_inf_nan=False, **bounds)

    def field(name: str, schema: cs.CoreSchema, *default: object) -> cs.DataclassField:
        if default:
            schema = cs.with_default_schema(schema, default=default[0])
        return cs.dataclass_field(name, schema)

    fields = [
        field("job_id", text),
        field("submit_time", number(ge=0)),
        field("team", text),
        field("replicas", cs.int_schema(ge=1)),
        field("gpus_per_replica", cs.no_info_after_validator_function(_check_gpus, number(gt=0))),
        field("duration", number(gt=0)),
        field("priority", cs.int_schema(), 0),
        field(
            "topology",
            cs.no_info_before_validator_function(
                _to_topology, cs.literal_schema(list(TOPOLOGY_CHOICES))
            ),
            "any",
        ),
        field(
            "preemptible", cs.no_info_before_validator_function(_to_bool, cs.bool_schema()), True
        ),
        field("cpus_per_replica", number(ge=0), 0.0),
        field("memory_gb_per_replica", number(ge=0), 0.0),
        field("time_limit_s", cs.nullable_schema(number(gt=0)), None),
        field("checkpoint_s", cs.nullable_schema(number(gt=0)), None),
        field(
            "gpu_model",
            cs.no_info_before_validator_function(_to_models, cs.nullable_schema(text)),
            None,
        ),
        field(
            "mixed_models", cs.no_info_before_validator_function(_to_bool, cs.bool_schema()), False
        ),
        field(
            "mig_profile",
            cs.nullable_schema(cs.no_info_after_validator_function(_check_profile, text)),
            None,
        ),
    ]
    job = cs.dataclass_schema(
        TraceJob,
        cs.dataclass_args_schema("TraceJob", fields),
        [f["name"] for f in fields],
        slots=True,
        frozen=True,
    )
    return SchemaValidator(cs.list_schema(job))


_ROWS = _row_validator()
_KNOWN = frozenset(REQUIRED_COLUMNS + OPTIONAL_COLUMNS)


def load_trace(path: Path) -> list[TraceJob]:
    """Read `path` and return its jobs sorted by (submit_time, file order).

    Raises TraceFormatError listing every problem: an empty file, missing required columns
    (line 1), each bad cell (its line and column) and each duplicate job_id (naming both lines).
    """
    path = Path(path)
    lines: list[int] = []
    rows: list[list[str]] = []
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, skipinitialspace=True)
        for cells in reader:
            if cells and any(cells):
                rows.append(cells)
                lines.append(reader.line_num)
    if not rows:
        raise TraceFormatError(
            path, [TraceProblem(1, "", f"file is empty; expected a header row with {_req()}")]
        )
    columns = [c.strip() for c in rows[0]]
    problems = _check_header(lines[0], columns)
    if problems:
        raise TraceFormatError(path, problems)
    if len(rows) == 1:
        raise TraceFormatError(
            path, [TraceProblem(lines[0], "", "the header has no job rows after it")]
        )
    lines, rows = lines[1:], rows[1:]

    width = len(columns)
    # Empty cells are left out so that optional columns take their defaults.
    dicts = [
        dict(zip(columns, cells, strict=False)) if "" not in cells else _non_empty(columns, cells)
        for cells in rows
    ]
    for line, cells in zip(lines, rows, strict=True):
        if len(cells) != width:
            problems.append(
                TraceProblem(
                    line,
                    "",
                    f"row has {len(cells)} cells but the header has {width} columns;"
                    " quote cells that contain commas",
                )
            )

    problems += _mig_shares(dicts, lines)
    jobs: list[TraceJob] = []
    try:
        jobs = _ROWS.validate_python(dicts)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            index, column = err["loc"][0], str(err["loc"][1])
            cell = dicts[index].get(column, "").strip()
            problems.append(TraceProblem(lines[index], column, _message(err, cell)))

    problems += _duplicates(lines, rows, columns.index("job_id"))
    if problems:
        order = {c: i for i, c in enumerate(columns)}
        problems.sort(key=lambda p: (p.line, order.get(p.column, -1) if p.column else -1))
        raise TraceFormatError(path, problems)
    jobs.sort(key=lambda j: j.submit_time)
    return jobs


def _mig_shares(dicts: list[dict[str, str]], lines: list[int]) -> list[TraceProblem]:
    """A MIG row's `gpus_per_replica` is its instance's compute share: filled in (in `dicts`)
    where left out, checked where given. A bad profile or number is the schema's to report."""
    problems = []
    for line, row in zip(lines, dicts, strict=True):
        profile = row.get("mig_profile", "").strip()
        if not profile or profile_problem(profile):
            continue
        share = share_of(profile)
        given = row.get("gpus_per_replica", "").strip()
        if not given:
            row["gpus_per_replica"] = str(share / GPU_UNIT)
            continue
        try:
            wrong = round(float(given) * GPU_UNIT) != share
        except ValueError:
            continue
        if wrong:
            problems.append(
                TraceProblem(
                    line,
                    "gpus_per_replica",
                    f"a {profile} instance counts {share / GPU_UNIT:g} GPUs (its compute "
                    "share); leave gpus_per_replica empty or give that",
                )
            )
    return problems


def _non_empty(columns: list[str], cells: list[str]) -> dict[str, str]:
    return {c: v for c, v in zip(columns, cells, strict=False) if v}


def _duplicates(lines: list[int], rows: list[list[str]], at: int) -> list[TraceProblem]:
    """One problem per repeated job_id, naming the line that used it first."""
    ids = [cells[at].strip() if at < len(cells) else "" for cells in rows]
    if len(set(ids)) == len(ids):
        return []
    problems = []
    first_seen: dict[str, int] = {}
    for line, job_id in zip(lines, ids, strict=True):
        if not job_id:
            continue
        if job_id in first_seen:
            problems.append(
                TraceProblem(
                    line,
                    "job_id",
                    f"duplicate job_id {job_id!r}, already used on line {first_seen[job_id]};"
                    " job_ids must be unique",
                )
            )
        else:
            first_seen[job_id] = line
    return problems


def _req() -> str:
    return ", ".join(REQUIRED_COLUMNS)


def _check_header(line: int, columns: list[str]) -> list[TraceProblem]:
    problems = []
    seen: set[str] = set()
    for c in columns:
        if c in _KNOWN and c in seen:
            problems.append(
                TraceProblem(line, c, "column appears more than once in the header; keep one")
            )
        seen.add(c)
    for c in REQUIRED_COLUMNS:
        if c not in seen:
            problems.append(
                TraceProblem(
                    line, c, f"required column is missing from the header (required: {_req()})"
                )
            )
    return problems


def _fmt(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)


def _show(cell: str) -> str:
    try:
        float(cell)
    except ValueError:
        return repr(cell)
    return cell


def _message(err: Any, cell: str) -> str:
    """Turn one pydantic error into a message a user can act on."""
    kind, ctx = err["type"], err.get("ctx") or {}
    got = _show(cell)
    if kind == "missing" or (kind == "string_too_short" and not cell):
        return "is required but the cell is empty"
    if kind == "greater_than":
        return f"must be > {_fmt(ctx['gt'])}, got {got}"
    if kind == "greater_than_equal":
        return f"must be >= {_fmt(ctx['ge'])}, got {got}"
    if kind in ("int_parsing", "int_from_float", "int_type"):
        return f"must be a whole number, got {got}"
    if kind in ("float_parsing", "float_type"):
        return f"must be a number, got {got}"
    if kind == "finite_number":
        return f"must be a finite number, got {got}"
    if kind == "literal_error":
        return f"must be one of {', '.join(TOPOLOGY_CHOICES)}; got {got}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return f"{err['msg']}, got {got}"
