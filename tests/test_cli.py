"""`berth` on the command line: simulate, compare, import, and errors before any work."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from berth.cli import app

CLUSTER = """
name: tiny
topology_levels: [rack]
slowdown: {gpu_group: 1.0, node: 1.2, rack: 1.5, cluster: 2.0}
node_pools:
  - {prefix: n, count: 4, gpus: 8, gpu_groups: 2, cpus: 64, memory_gb: 512, nodes_per_rack: 2}
"""
TEAMS = """
teams:
  - {name: vision, nominal: {gpus: 16}}
  - {name: nlp, nominal: {gpus: 16}, borrowing_limit: {gpus: 8}}
"""


def _inputs(tmp_path: Path, rows: list[str]) -> dict[str, Path]:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "teams.yaml").write_text(TEAMS)
    header = "job_id,submit_time,team,replicas,gpus_per_replica,duration,priority,topology\n"
    (tmp_path / "jobs.csv").write_text(header + "\n".join(rows) + "\n")
    return {
        n: tmp_path / f
        for n, f in (("cluster", "cluster.yaml"), ("teams", "teams.yaml"), ("trace", "jobs.csv"))
    }


def _rows() -> list[str]:
    rows = []
    for i in range(40):
        team = "vision" if i % 2 else "nlp"
        replicas, gpus = [(1, 1), (1, 4), (2, 8), (1, 0.5), (4, 2)][i % 5]
        rows.append(f"j{i},{i * 30},{team},{replicas},{gpus},{200 + 37 * i},{i % 3},any")
    rows.append("too-big,5,vision,9,8,100,0,any")  # can never run: rejected in the events
    return rows


def test_simulate_writes_events_summary_report_and_plots(tmp_path):
    p = _inputs(tmp_path, _rows())
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "--cluster",
            str(p["cluster"]),
            "--teams",
            str(p["teams"]),
            "--trace",
            str(p["trace"]),
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    rejects = [e for e in events if e["type"] == "reject"]
    assert [e["job"] for e in rejects] == ["too-big"] and "may hold at most" in rejects[0][
        "message"
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["jobs"] == 41 and summary["finished"] == 40 and summary["rejected"] == 1
    for f in ("report.md", "queue_and_utilization.png", "jct_cdf.png", "team_usage.png"):
        assert (out / f).stat().st_size > 0
    assert "berth" in res.output  # the summary table


def test_compare_runs_each_policy_on_the_same_inputs(tmp_path):
    p = _inputs(tmp_path, _rows())
    out = tmp_path / "cmp"
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "--cluster",
            str(p["cluster"]),
            "--teams",
            str(p["teams"]),
            "--trace",
            str(p["trace"]),
            "--out",
            str(out),
            "--compare",
            "fifo,quota-spread,berth",
        ],
    )
    assert res.exit_code == 0, res.output
    table = json.loads((out / "compare.json").read_text())
    assert table["policies"] == ["fifo", "quota-spread", "berth"]
    for pol in ("fifo", "quota-spread", "berth"):
        assert (out / pol / "events.jsonl").exists()
    assert (out / "compare.md").read_text().count("|") > 10


def test_malformed_trace_stops_before_simulating_and_lists_every_bad_row(tmp_path):
    rows = _rows()
    rows[3] = "j3,30,nlp,0,1,100,0,any"  # replicas 0
    rows[7] = "j7,abc,nlp,1,1,-5,0,sideways"  # three bad cells
    p = _inputs(tmp_path, rows)
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "--cluster",
            str(p["cluster"]),
            "--teams",
            str(p["teams"]),
            "--trace",
            str(p["trace"]),
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 2
    for needle in ("line 5", "replicas", "line 9", "submit_time", "duration", "topology"):
        assert needle in res.output
    assert not out.exists()  # nothing simulated, nothing written


def test_unknown_policy_and_bad_config_are_clear_errors(tmp_path):
    p = _inputs(tmp_path, _rows())
    common = [
        "simulate",
        "--cluster",
        str(p["cluster"]),
        "--teams",
        str(p["teams"]),
        "--trace",
        str(p["trace"]),
        "--out",
        str(tmp_path / "o"),
    ]
    res = CliRunner().invoke(app, [*common, "--policy", "lottery"])
    assert res.exit_code == 2 and "unknown policy 'lottery'" in res.output
    p["teams"].write_text("teams:\n  - {name: vision, nominal: {gpus: lots}}\n")
    res = CliRunner().invoke(app, common)
    assert res.exit_code == 2 and "nominal.gpus" in res.output


def test_check_prints_what_the_files_declare(tmp_path):
    p = _inputs(tmp_path, _rows())
    res = CliRunner().invoke(
        app, ["check", "--cluster", str(p["cluster"]), "--teams", str(p["teams"])]
    )
    assert res.exit_code == 0
    assert "4 nodes, 32 GPUs" in res.output and "team nlp" in res.output
