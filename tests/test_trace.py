"""Tests for loading and validating simulator traces (`scheduling.simulator.trace`)."""

from __future__ import annotations

import csv
import io
from dataclasses import astuple
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.simulator.trace import (
    REQUIRED_COLUMNS,
    TraceFormatError,
    TraceJob,
    TraceProblem,
    load_trace,
)

HEADER = ",".join(REQUIRED_COLUMNS)
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def write(tmp_path: Path, text: str, name: str = "jobs.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path: Path) -> list[tuple[int, str, str]]:
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    return [(p.line, p.column, p.message) for p in info.value.problems]


def test_minimal_trace_gets_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, f"{HEADER}\nj1,0,alpha,2,4,3600\n")
    assert load_trace(path) == [TraceJob("j1", 0.0, "alpha", 2, 4.0, 3600.0)]
    job = load_trace(path)[0]
    assert (job.priority, job.topology, job.preemptible) == (0, "any", True)
    assert (job.cpus_per_replica, job.memory_gb_per_replica) == (0.0, 0.0)


def test_all_columns_any_order_and_unknown_columns_ignored(tmp_path: Path) -> None:
    text = (
        "note,memory_gb_per_replica,duration,preemptible,team,topology,job_id,priority,"
        "gpus_per_replica,cpus_per_replica,replicas,submit_time,\n"
        "hello,64.5,10.5,No,beta,Rack,x,-3,0.25,8,1,12.5,\n"
    )
    assert load_trace(write(tmp_path, text)) == [
        TraceJob("x", 12.5, "beta", 1, 0.25, 10.5, -3, "rack", False, 8.0, 64.5)
    ]


def test_empty_optional_cells_take_defaults(tmp_path: Path) -> None:
    text = (
        f"{HEADER},priority,topology,preemptible,cpus_per_replica,memory_gb_per_replica\n"
        "a,1,t,1,1,5,,,,,\n"
        "b,2,t,1,1,5,  ,  ,  ,  ,  \n"
    )
    assert load_trace(write(tmp_path, text)) == [
        TraceJob("a", 1.0, "t", 1, 1.0, 5.0),
        TraceJob("b", 2.0, "t", 1, 1.0, 5.0),
    ]


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("Yes", True),
        ("false", False),
        ("False", False),
        ("0", False),
        ("NO", False),
    ],
)
def test_preemptible_spellings(tmp_path: Path, cell: str, expected: bool) -> None:
    path = write(tmp_path, f"{HEADER},preemptible\nj,0,t,1,1,5,{cell}\n")
    assert load_trace(path)[0].preemptible is expected


def test_preemptible_rejects_other_words(tmp_path: Path) -> None:
    path = write(tmp_path, f"{HEADER},preemptible\nj,0,t,1,1,5,on\n")
    assert problems_of(path) == [
        (2, "preemptible", "must be one of true/false/1/0/yes/no, got 'on'")
    ]


def test_sorted_by_submit_time_then_file_order(tmp_path: Path) -> None:
    text = f"{HEADER}\nc,5,t,1,1,1\na,0,t,1,1,1\nd,5,t,1,1,1\nb,0.5,t,1,1,1\ne,0,t,1,1,1\n"
    assert [j.job_id for j in load_trace(write(tmp_path, text))] == ["a", "e", "b", "c", "d"]


def test_whitespace_bom_blank_lines_and_quoted_commas(tmp_path: Path) -> None:
    text = f'\ufeff{HEADER}\n\n  j1 , 1 , "team, one" , 2 , 0.5 , 7 \n\n'
    assert load_trace(write(tmp_path, text)) == [TraceJob("j1", 1.0, "team, one", 2, 0.5, 7.0)]


@pytest.mark.parametrize("gpus", ["0.5", "0.125", "0.001", "0.999", "1", "2.0", "8", "16"])
def test_gpus_per_replica_accepted(tmp_path: Path, gpus: str) -> None:
    path = write(tmp_path, f"{HEADER}\nj,0,t,1,{gpus},5\n")
    assert load_trace(path)[0].gpus_per_replica == float(gpus)


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ("-1", "must be > 0, got -1"),
        ("0", "must be > 0, got 0"),
        ("0.0001", "a share of one GPU must be from 0.001 to 0.999 in steps of 0.001, got 0.0001"),
        ("0.3333", "a share of one GPU must be from 0.001 to 0.999 in steps of 0.001, got 0.3333"),
        ("1.5", "must be a whole number >= 1 or a fraction below 1 (e.g. 0.25), got 1.5"),
        ("two", "must be a number, got 'two'"),
        ("inf", "must be a finite number, got inf"),
    ],
)
def test_gpus_per_replica_rejected(tmp_path: Path, gpus: str, message: str) -> None:
    path = write(tmp_path, f"{HEADER}\nj,0,t,1,{gpus},5\n")
    [(row, column, got)] = problems_of(path)
    assert (row, column) == (2, "gpus_per_replica")
    assert got.startswith(message)


def test_every_bad_cell_of_every_row_is_reported(tmp_path: Path) -> None:
    text = (
        f"{HEADER},topology,priority,cpus_per_replica\n"
        "ok,0,t,1,1,5,any,0,0\n"
        "a,-1,t,0,1,0,any,0,0\n"
        ",0,,1.5,1,5,torus,high,-2\n"
        "ok2,0,t,1,1,5,node,1,1\n"
        "b,x,t,1,1,nan,block,0,0\n"
    )
    path = write(tmp_path, text)
    assert problems_of(path) == [
        (3, "submit_time", "must be >= 0, got -1"),
        (3, "replicas", "must be >= 1, got 0"),
        (3, "duration", "must be > 0, got 0"),
        (4, "job_id", "is required but the cell is empty"),
        (4, "team", "is required but the cell is empty"),
        (4, "replicas", "must be a whole number, got 1.5"),
        (4, "topology", "must be one of any, gpu_group, node, rack, block; got 'torus'"),
        (4, "priority", "must be a whole number, got 'high'"),
        (4, "cpus_per_replica", "must be >= 0, got -2"),
        (6, "submit_time", "must be a number, got 'x'"),
        (6, "duration", "must be a finite number, got nan"),
    ]


def test_error_message_lists_problems_one_per_line(tmp_path: Path) -> None:
    path = write(tmp_path, f"{HEADER}\nj,0,t,1,-1,5\nk,0,t,1,1,-5\n")
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert str(info.value).splitlines() == [
        f"{path}: 2 problems in trace",
        "  line 2, column gpus_per_replica: must be > 0, got -1",
        "  line 3, column duration: must be > 0, got -5",
    ]
    assert isinstance(info.value, ValueError)


def test_error_message_is_capped_but_problems_are_complete(tmp_path: Path) -> None:
    rows = "".join(f"j{i},0,t,1,1,-{i + 1}\n" for i in range(120))
    with pytest.raises(TraceFormatError) as info:
        load_trace(write(tmp_path, HEADER + "\n" + rows))
    assert len(info.value.problems) == 120
    lines = str(info.value).splitlines()
    assert lines[0].endswith("120 problems in trace")
    assert lines[1] == "  line 2, column duration: must be > 0, got -1"
    assert lines[50] == "  line 51, column duration: must be > 0, got -50"
    assert lines[51:] == ["  ... and 70 more"]


def test_missing_required_columns_reported_on_line_1(tmp_path: Path) -> None:
    path = write(tmp_path, "job_id,team,duration,priority\nj,t,5,1\n")
    expected = (
        f"required column is missing from the header (required: {', '.join(REQUIRED_COLUMNS)})"
    )
    assert problems_of(path) == [
        (1, "submit_time", expected),
        (1, "replicas", expected),
        (1, "gpus_per_replica", expected),
    ]


def test_duplicate_known_column_in_header(tmp_path: Path) -> None:
    path = write(tmp_path, f"{HEADER},team\nj,0,t,1,1,5,u\n")
    assert problems_of(path) == [
        (1, "team", "column appears more than once in the header; keep one")
    ]


@pytest.mark.parametrize("text", ["", "\n\n", " , ,\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    (problem,) = problems_of(write(tmp_path, text))
    assert problem[:2] == (1, "")
    assert problem[2].startswith("file is empty; expected a header row with job_id, submit_time")


def test_header_without_rows(tmp_path: Path) -> None:
    assert problems_of(write(tmp_path, HEADER + "\n")) == [
        (1, "", "the header has no job rows after it")
    ]


def test_duplicate_job_ids_name_both_lines(tmp_path: Path) -> None:
    text = f"{HEADER}\na,0,t,1,1,5\nb,0,t,1,1,5\n a ,1,t,1,1,5\nb,2,t,1,1,5\na,3,t,1,1,5\n"
    message = "duplicate job_id {!r}, already used on line {}; job_ids must be unique"
    assert problems_of(write(tmp_path, text)) == [
        (4, "job_id", message.format("a", 2)),
        (5, "job_id", message.format("b", 3)),
        (6, "job_id", message.format("a", 2)),
    ]


def test_row_with_wrong_cell_count(tmp_path: Path) -> None:
    text = f"{HEADER}\nj,0,t,1,1,5,extra\nk,0,t,1,1\n"
    assert problems_of(write(tmp_path, text)) == [
        (2, "", "row has 7 cells but the header has 6 columns; quote cells that contain commas"),
        (3, "", "row has 5 cells but the header has 6 columns; quote cells that contain commas"),
        (3, "duration", "is required but the cell is empty"),
    ]


def test_problem_str() -> None:
    assert str(TraceProblem(7, "gpus_per_replica", "must be > 0, got -1")) == (
        "line 7, column gpus_per_replica: must be > 0, got -1"
    )
    assert str(TraceProblem(3, "", "row has 2 cells")) == "line 3: row has 2 cells"


jobs_strategy = st.lists(
    st.builds(
        TraceJob,
        job_id=st.text("abcxyz-_0123456789", min_size=1, max_size=8),
        submit_time=st.floats(0, 1e7, allow_nan=False),
        team=st.sampled_from(["alpha", "beta", "team, with comma", 'q"uote']),
        replicas=st.integers(1, 64),
        gpus_per_replica=st.one_of(
            st.integers(1, 16).map(float), st.integers(1, 999).map(lambda k: k / 1000)
        ),
        duration=st.floats(0.001, 1e7, allow_nan=False),
        priority=st.integers(-100, 100),
        topology=st.sampled_from(["any", "gpu_group", "node", "rack", "block"]),
        preemptible=st.booleans(),
        cpus_per_replica=st.floats(0, 256, allow_nan=False),
        memory_gb_per_replica=st.floats(0, 4096, allow_nan=False),
    ),
    min_size=1,
    max_size=20,
    unique_by=lambda j: j.job_id,
)


def to_csv(jobs: list[TraceJob]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(TraceJob.__slots__)
    writer.writerows(astuple(j) for j in jobs)  # floats as repr, bools as True/False
    return buffer.getvalue()


@HYPOTHESIS
@given(jobs=jobs_strategy)
def test_round_trip_of_valid_jobs(tmp_path: Path, jobs: list[TraceJob]) -> None:
    path = write(tmp_path, to_csv(jobs))
    assert load_trace(path) == sorted(jobs, key=lambda j: j.submit_time)


BAD_CELLS = {
    "submit_time": ["-1", "abc", "nan", ""],
    "team": [""],
    "replicas": ["0", "-2", "1.5", "x", ""],
    "gpus_per_replica": ["0", "-0.5", "1.25", "0.0005", "gpu", ""],
    "duration": ["0", "-3", "inf", "soon", ""],
    "priority": ["1.5", "urgent"],
    "topology": ["torus", "nodes"],
    "preemptible": ["maybe", "2"],
    "cpus_per_replica": ["-1", "many"],
    "memory_gb_per_replica": ["-0.5", "big"],
}
GOOD_ROW = {
    "job_id": "j",
    "submit_time": "0",
    "team": "t",
    "replicas": "1",
    "gpus_per_replica": "1",
    "duration": "5",
    "priority": "0",
    "topology": "any",
    "preemptible": "true",
    "cpus_per_replica": "0",
    "memory_gb_per_replica": "0",
}


@st.composite
def damaged_traces(draw: st.DrawFn) -> tuple[list[dict[str, str]], set[tuple[int, str]]]:
    rows, expected = [], set()
    for i in range(draw(st.integers(1, 15))):
        row = dict(GOOD_ROW, job_id=f"job-{i}")
        for column in draw(st.sets(st.sampled_from(sorted(BAD_CELLS)), max_size=4)):
            row[column] = draw(st.sampled_from(BAD_CELLS[column]))
            expected.add((i + 2, column))
        rows.append(row)
    return rows, expected


@HYPOTHESIS
@given(case=damaged_traces())
def test_random_malformed_cells_are_all_reported(
    tmp_path: Path, case: tuple[list[dict[str, str]], set[tuple[int, str]]]
) -> None:
    rows, expected = case
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(GOOD_ROW), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path = write(tmp_path, buffer.getvalue())
    if not expected:
        assert len(load_trace(path)) == len(rows)
        return
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    found = [(p.line, p.column) for p in info.value.problems]
    assert len(found) == len(set(found))
    assert set(found) == expected
    assert found == sorted(found, key=lambda lc: (lc[0], list(GOOD_ROW).index(lc[1])))


def test_loads_a_philly_sized_trace(tmp_path: Path) -> None:
    rows = "".join(
        f"philly-{i:06d},{i * 7},vc-{i % 15},{1 + i % 4},{2 ** (i % 4)},{100 + i},0,any,true\n"
        for i in range(82_247)
    )
    header = HEADER + ",priority,topology,preemptible\n"
    path = write(tmp_path, header + rows)
    jobs = load_trace(path)  # its speed is measured by bench/philly_bench.py, not here
    assert len(jobs) == 82_247
    assert jobs[-1] == TraceJob("philly-082246", 575_722.0, "vc-1", 3, 4.0, 82_346.0)
