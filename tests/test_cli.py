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


def test_check_shows_the_organization_tree_and_where_each_team_sits(tmp_path):
    (tmp_path / "cluster.yaml").write_text("name: c\nnodes:\n  - {name: n0, gpus: 8}\n")
    (tmp_path / "teams.yaml").write_text(
        "cohorts:\n"
        "  - {name: research, lending_limit: {gpus: 4}}\n"
        "  - {name: nlp, parent: research, borrowing_limit: {gpus: 8}}\n"
        "teams:\n"
        "  - {name: a, cohort: nlp, nominal: {gpus: 8}}\n"
        "  - {name: b, cohort: research, nominal: {gpus: 8}}\n"
        "  - {name: c, nominal: {gpus: 8}}\n"
    )
    args = ["check", "--cluster", str(tmp_path / "cluster.yaml")]
    res = CliRunner().invoke(app, [*args, "--teams", str(tmp_path / "teams.yaml")])
    assert res.exit_code == 0, res.output
    assert "  cohort research: quota 16 GPUs (own 0), keeps 12, lends 4" in res.output
    assert (
        "    cohort nlp: quota 8 GPUs" in res.output and "borrowing_limit 8; teams a" in res.output
    )
    assert "team a in cohort nlp < research:" in res.output
    assert "may hold up to 16 GPUs" in res.output  # nlp's 8 + the 8 it may borrow
    assert "team c: nominal" in res.output and "may hold up to 12 GPUs" in res.output
    (tmp_path / "teams.yaml").write_text(
        "cohorts: [{name: x, parent: y}]\nteams: [{name: a, cohort: x, nominal: {gpus: 1}}]\n"
    )
    res = CliRunner().invoke(app, [*args, "--teams", str(tmp_path / "teams.yaml")])
    assert res.exit_code != 0 and "parent 'y' is not a cohort" in res.output


def _preempting_inputs(tmp_path: Path) -> list[str]:
    """a and b take 4 of 6 GPUs; p (3 GPUs, priority 2) preempts b (priority 0, below a's 1:
    the cheaper loss) at 601; b is back at 701."""
    (tmp_path / "cluster.yaml").write_text(
        "name: two\nnodes:\n  - {name: n0, gpus: 3}\n  - {name: n1, gpus: 3}\n"
    )
    (tmp_path / "teams.yaml").write_text("teams:\n  - {name: t, nominal: {gpus: 6}}\n")
    (tmp_path / "jobs.csv").write_text(
        "job_id,submit_time,team,replicas,gpus_per_replica,duration,priority\n"
        "a,0,t,1,2,3000,1\nb,0,t,1,2,3000,0\np,1,t,1,3,100,2\n"
    )
    return [
        "simulate",
        *("--cluster", str(tmp_path / "cluster.yaml")),
        *("--teams", str(tmp_path / "teams.yaml")),
        *("--trace", str(tmp_path / "jobs.csv")),
    ]


def test_restart_cost_delays_a_preempted_job_and_counts_as_lost_work(tmp_path):
    args = _preempting_inputs(tmp_path)
    finish_b, lost = {}, {}
    for cost in ("default", "0", "120"):
        out = tmp_path / cost
        extra = [] if cost == "default" else ["--restart-cost", cost]
        res = CliRunner().invoke(app, [*args, "--out", str(out), *extra])
        assert res.exit_code == 0, res.output
        events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
        finish_b[cost] = next(e["t"] for e in events if e["type"] == "finish" and e["job"] == "b")
        lost[cost] = json.loads((out / "summary.json").read_text())["gpu_hours_lost_to_preemption"]
    assert finish_b == {"default": 701 + 3000 + 60, "0": 701 + 3000, "120": 701 + 3000 + 120}
    # b's 601 s before the preemption, plus its restart, on 2 GPUs
    assert lost == {
        c: round((601 + r) * 2 / 3600, 4) for c, r in (("default", 60), ("0", 0), ("120", 120))
    }


def test_negative_or_infinite_restart_cost_is_refused_before_simulating(tmp_path):
    args = _preempting_inputs(tmp_path)
    for bad in ("-5", "inf"):
        out = tmp_path / f"o{bad}"
        res = CliRunner().invoke(app, [*args, "--out", str(out), "--restart-cost", bad])
        assert res.exit_code == 2, res.output
        assert "restart-cost" in res.output
        assert not out.exists()


def test_a_policy_file_runs_beside_the_named_policies_and_a_bad_one_is_refused(tmp_path):
    p = _inputs(tmp_path, _rows())
    args = ["simulate", "--cluster", str(p["cluster"]), "--teams", str(p["teams"])]
    args += ["--trace", str(p["trace"])]
    good = tmp_path / "policy.yaml"
    good.write_text("name: patient\nstarvation_s: 7200\nmin_runtime_s: 900\n")
    out = tmp_path / "cmp"
    res = CliRunner().invoke(
        app, [*args, "--out", str(out), "--compare", "berth", "--policy-file", str(good)]
    )
    assert res.exit_code == 0, res.output
    assert json.loads((out / "patient" / "summary.json").read_text())["policy"] == "patient"
    assert (out / "berth" / "summary.json").exists() and (out / "compare.md").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("min_runtime_s: -1\n")
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "x"), "--policy-file", str(bad)])
    assert res.exit_code == 2
    assert "min_runtime_s" in res.output and not (tmp_path / "x").exists()
