"""Tests for importing the Philly trace (`scheduling.simulator.philly`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from shared_data import philly_dir

from scheduling.simulator.philly import (
    PhillyFormatError,
    PhillyImport,
    PhillyImportError,
    import_philly,
    largest_remainder,
)
from scheduling.simulator.trace import TraceJob, load_trace

HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def source(tmp_path: Path, rows: list[str], name: str = "philly.csv") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + "".join(f"{r}\n" for r in rows), encoding="utf-8")
    return path


def run(src: Path, tmp_path: Path, gpus: int = 16, **kwargs: int) -> PhillyImport:
    return import_philly(src, gpus, tmp_path / "out", show_progress=False, **kwargs)


def test_jobs_sorted_stably_with_ids_times_and_teams(tmp_path: Path) -> None:
    src = source(
        tmp_path,
        [
            "2017-10-01 00:01:00,30.0,1,30.0,bbb",
            "2017-10-01 00:00:00,66.0,2,132.0,aaa",
            "2017-10-01 00:01:00,40.0,1,40.0,aaa",
            "2017-10-02 00:00:00,10.5,4,42.0,bbb",
        ],
    )
    result = run(src, tmp_path)
    assert result.jobs_path.read_text() == (
        "job_id,submit_time,team,replicas,gpus_per_replica,duration,priority,topology,preemptible\n"
        "philly-000001,0,vc-aaa,1,2,66,0,any,true\n"
        "philly-000002,60,vc-bbb,1,1,30,0,any,true\n"
        "philly-000003,60,vc-aaa,1,1,40,0,any,true\n"
        "philly-000004,86400,vc-bbb,1,4,10.5,0,any,true\n"
    )
    assert result == PhillyImport(
        jobs=4,
        teams=2,
        gangs=0,
        clamped_durations=0,
        jobs_path=tmp_path / "out" / "jobs.csv",
        teams_path=tmp_path / "out" / "teams.yaml",
        cluster_path=tmp_path / "out" / "cluster.yaml",
    )


def test_big_jobs_become_gangs_of_whole_nodes(tmp_path: Path) -> None:
    sizes = [1, 8, 12, 16, 24, 32, 64, 128]
    rows = [f"2017-10-01 00:00:{i:02d},100,{n},{100 * n},vc" for i, n in enumerate(sizes)]
    result = run(source(tmp_path, rows), tmp_path, gpus=128)
    jobs = load_trace(result.jobs_path)
    assert [(j.replicas, j.gpus_per_replica) for j in jobs] == [
        (1, 1.0),
        (1, 8.0),
        (2, 6.0),
        (2, 8.0),
        (3, 8.0),
        (4, 8.0),
        (8, 8.0),
        (16, 8.0),
    ]
    assert result.gangs == 6


def test_gang_split_with_other_node_size(tmp_path: Path) -> None:
    rows = [f"2017-10-01 00:00:0{i},100,{n},{100 * n},vc" for i, n in enumerate([2, 4, 6, 12])]
    result = run(source(tmp_path, rows), tmp_path, gpus=12, gpus_per_node=4)
    jobs = load_trace(result.jobs_path)
    assert [(j.replicas, j.gpus_per_replica) for j in jobs] == [(1, 2), (1, 4), (2, 3), (3, 4)]
    cluster = yaml.safe_load(result.cluster_path.read_text())
    assert cluster["node_pools"][0]["count"] == 3
    assert cluster["node_pools"][0]["gpus"] == 4


def test_uneven_gang_split_is_a_clear_error(tmp_path: Path) -> None:
    rows = ["2017-10-01 00:00:00,100,64,6400,vc", "2017-10-01 00:00:01,100,7,700,vc"]
    with pytest.raises(PhillyImportError) as info:
        run(source(tmp_path, rows), tmp_path, gpus=10, gpus_per_node=5)
    assert str(info.value) == (
        "with gpus_per_node=5 some jobs do not split into equal replicas"
        " (7 GPUs into 2 replicas; 64 GPUs into 13 replicas);"
        " pick a gpus_per_node that divides these job sizes evenly"
    )


def test_nonpositive_durations_are_clamped_and_counted(tmp_path: Path) -> None:
    rows = [
        "2017-10-01 00:00:00,0,1,0,a",
        "2017-10-01 00:00:01,-5.0,1,0,a",
        "2017-10-01 00:00:02,0.5,1,0.5,a",
    ]
    result = run(source(tmp_path, rows), tmp_path)
    assert result.clamped_durations == 2
    assert [j.duration for j in load_trace(result.jobs_path)] == [1.0, 1.0, 0.5]


def test_teams_yaml_largest_remainder_sums_to_n(tmp_path: Path) -> None:
    # gpu_time shares 0.5, 0.3, 0.17, 0.03 of 16 GPUs: quotas 8, 4.8, 2.72, 0.48
    rows = [
        "2017-10-01 00:00:00,500,1,500,big",
        "2017-10-01 00:00:01,300,1,300,mid",
        "2017-10-01 00:00:02,170,1,170,small",
        "2017-10-01 00:00:03,30,1,30,tiny",
        "2017-10-01 00:00:04,0,1,0,zero",
    ]
    result = run(source(tmp_path, rows), tmp_path, gpus=16)
    text = result.teams_path.read_text()
    assert text.startswith("# ")
    assert "largest-remainder" in text.split("teams:")[0]
    assert yaml.safe_load(text) == {
        "teams": [
            {"name": "vc-big", "nominal": {"gpus": 8}, "weight": 1},
            {"name": "vc-mid", "nominal": {"gpus": 5}, "weight": 1},
            {"name": "vc-small", "nominal": {"gpus": 3}, "weight": 1},
            {"name": "vc-tiny", "nominal": {"gpus": 0}, "weight": 1},
            {"name": "vc-zero", "nominal": {"gpus": 0}, "weight": 1},
        ]
    }
    assert result.teams == 5


def test_odd_team_names_are_quoted_in_yaml(tmp_path: Path) -> None:
    rows = ['2017-10-01 00:00:00,5,1,5,"a: #b"']
    result = run(source(tmp_path, rows), tmp_path, gpus=8)
    assert yaml.safe_load(result.teams_path.read_text())["teams"][0]["name"] == "vc-a: #b"
    assert load_trace(result.jobs_path)[0].team == "vc-a: #b"


def test_cluster_yaml_exact(tmp_path: Path) -> None:
    result = run(source(tmp_path, ["2017-10-01 00:00:00,5,1,5,a"]), tmp_path, gpus=1024)
    assert result.cluster_path.read_text() == (
        "name: philly-1024\n"
        "topology_levels: [block, rack]\n"
        "slowdown: {gpu_group: 1.0, node: 1.1, rack: 1.3, block: 1.5, cluster: 1.8}\n"
        "node_pools:\n"
        "  - prefix: node\n"
        "    count: 128\n"
        "    gpus: 8\n"
        "    gpu_model: V100\n"
        "    gpu_groups: 2          # two NVLink islands of 4 GPUs\n"
        "    cpus: 64\n"
        "    memory_gb: 512\n"
        "    nodes_per_rack: 8\n"
        "    racks_per_block: 4\n"
    )
    assert yaml.safe_load(result.cluster_path.read_text())["slowdown"]["cluster"] == 1.8


@pytest.mark.parametrize("gpus", [0, -8, 4, 12, 1001])
def test_gpus_must_be_whole_nodes(tmp_path: Path, gpus: int) -> None:
    src = source(tmp_path, ["2017-10-01 00:00:00,5,1,5,a"])
    with pytest.raises(PhillyImportError, match=r"--gpus must be a positive multiple of gpus_per"):
        run(src, tmp_path, gpus=gpus)
    assert not (tmp_path / "out").exists()


def test_src_may_be_a_directory(tmp_path: Path) -> None:
    source(tmp_path, ["2017-10-01 00:00:00,5,1,5,a"])
    assert run(tmp_path, tmp_path).jobs == 1
    with pytest.raises(FileNotFoundError, match=r"philly\.csv"):
        run(tmp_path / "out", tmp_path)


def test_malformed_source_rows_all_reported(tmp_path: Path) -> None:
    rows = [
        "2017-10-01 00:00:00,5,1,5,a",
        "yesterday,5,1,5,a",
        "2017-10-01 00:00:00,fast,1.5,-1,",
        "2017-10-01 00:00:00,nan,0,5,a",
        "2017-10-01 00:00:00,5",
    ]
    with pytest.raises(PhillyFormatError) as info:
        run(source(tmp_path, rows), tmp_path)
    assert [(p.line, p.column, p.message) for p in info.value.problems] == [
        (3, "timestamp", "must be YYYY-MM-DD HH:MM:SS, got 'yesterday'"),
        (4, "duration", "must be a finite number, got 'fast'"),
        (4, "num_gpus", "must be a whole number >= 1, got '1.5'"),
        (4, "gpu_time", "must be >= 0, got -1"),
        (4, "cluster", "is required but the cell is empty"),
        (5, "duration", "must be a finite number, got 'nan'"),
        (5, "num_gpus", "must be a whole number >= 1, got '0'"),
        (6, "", "row has 2 cells but the header has 5"),
    ]


def test_missing_source_column(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_text("timestamp,duration,num_gpus,vc\n2017-10-01 00:00:00,5,1,a\n")
    with pytest.raises(PhillyFormatError) as info:
        run(path, tmp_path)
    assert [(p.line, p.column) for p in info.value.problems] == [(1, "gpu_time"), (1, "cluster")]


def test_largest_remainder_examples() -> None:
    assert largest_remainder([50, 30, 17, 3], 16) == [8, 5, 3, 0]
    assert largest_remainder([1, 1, 1], 10) == [4, 3, 3]
    assert largest_remainder([0, 0], 5) == [3, 2]
    assert largest_remainder([1, 0], 7) == [7, 0]
    assert largest_remainder([], 7) == []


@given(
    weights=st.lists(st.floats(0, 1e9, allow_nan=False), min_size=1, max_size=20),
    total=st.integers(0, 10_000),
)
def test_largest_remainder_properties(weights: list[float], total: int) -> None:
    parts = largest_remainder(weights, total)
    assert sum(parts) == total
    assert all(p >= 0 for p in parts)
    weight_sum = sum(weights)
    if weight_sum > 0:
        for w, p in zip(weights, parts, strict=True):
            assert abs(p - total * w / weight_sum) < 1 + 1e-6


@pytest.mark.slow
def test_full_philly_trace(tmp_path: Path) -> None:
    result = import_philly(philly_dir(), 1024, tmp_path, show_progress=False)
    jobs = load_trace(result.jobs_path)
    assert (result.jobs, result.teams, result.gangs, result.clamped_durations) == (
        82_247,
        15,
        289,
        0,
    )
    assert len(jobs) == 82_247
    assert jobs[0] == TraceJob("philly-000001", 0.0, "vc-7f04ca", 1, 8.0, 2_240_194.0)
    assert [j.job_id for j in jobs] == [f"philly-{i:06d}" for i in range(1, 82_248)]
    teams = yaml.safe_load(result.teams_path.read_text())["teams"]
    assert len(teams) == 15
    assert sum(t["nominal"]["gpus"] for t in teams) == 1024
    assert {j.team for j in jobs} == {t["name"] for t in teams}
    assert max(j.replicas * j.gpus_per_replica for j in jobs) == 128
