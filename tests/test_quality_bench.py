"""`bench.quality` on smoke-test sizes: the files and figures it promises, not its verdict."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from shared_data import philly_dir

from bench import quality

POLICIES = [
    "kueue-tas",
    "berth",
    "berth-quick-reclaim",
    "berth-no-deadline",
    "quota-spread",
    "fifo-backfill",
]


def quiet() -> Console:
    return Console(file=io.StringIO(), width=150)


def check_files(out: Path, report: dict[str, Any]) -> None:
    assert json.loads(out.read_text()) == report
    assert out.with_suffix(".png").stat().st_size > 10_000
    md = out.with_suffix(".md").read_text()
    assert "## Held-out cases" in md and "SRTF oracle" in md and "## Tuning cases" in md


def check_case(case: dict[str, Any], policies: list[str]) -> None:
    assert set(case["results"]) == {*policies, "oracle"}
    for policy in policies:
        r = case["results"][policy]
        assert r["unfinished"] == 0 and r["rejected"] == 0
        assert r["finished"] == r["jobs"]
        assert "p99_first_wait_big_s" in r
    oracle = case["results"]["oracle"]
    assert oracle["finished"] == case["results"]["berth"]["jobs"]
    # The oracle is a floor: no placement, no quota, free preemption.
    assert all(x >= 0.999 for x in case["jct_over_oracle"].values())
    for policy in policies[1:]:
        v = case["versus_baseline"][policy]["avg_jct_s"]
        base = case["results"]["kueue-tas"]["avg_jct_s"]
        assert v["value"] == pytest.approx(case["results"][policy]["avg_jct_s"] / base, abs=1e-4)
        assert v["no_worse"] == (case["results"][policy]["avg_jct_s"] <= base)
    assert 0.5 < case["offered_load"]["dominant"] < 2


def test_quick_synthetic_run_writes_the_json_markdown_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    report = quality.main(["--quick", "--no-philly", "--out", str(out)], console=quiet())
    check_files(out, report)
    assert report["benchmark"] == "quality" and report["config"]["baseline"] == "kueue-tas"
    assert report["config"]["policies"] == POLICIES
    assert {"python", "cpus", "reference_ms_before", "reference_ms_after"} <= set(report["machine"])
    assert set(report["code"]) == {"commit", "scheduling_modified", "scheduling_sha256"}
    assert isinstance(report["code_changed_during_run"], bool)
    names = [c["name"] for c in report["cases"]]
    default = [f for f, family in quality.FAMILIES.items() if family.default]
    assert names == [f"{f}-s1" for f in default]  # --quick: seed 1 of each default family
    assert all(c["role"] == "held-out" for c in report["cases"])
    for case in report["cases"]:
        check_case(case, POLICIES)
    held = report["held_out"]
    assert held["cases"] == len(names)
    jct = held["metrics"]["avg_jct_s"]["berth"]
    assert jct["cases"] == len(names) and jct["min"] <= jct["median"] <= jct["max"]
    assert jct["p10"] <= jct["median"] <= jct["p90"] and jct["geomean"] > 0
    assert 0 <= jct["no_worse_fraction"] <= 1
    assert "mean" in held["metrics"]["jain_fairness"]["berth"]  # a difference, not a ratio
    assert set(held["jct_over_oracle"]) == set(POLICIES)


def test_quick_run_replays_a_held_out_philly_window(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    args = ["--quick", "--trace-dir", str(philly_dir()), "--families", "gangs", "--out", str(out)]
    report = quality.main(args, console=quiet())
    check_files(out, report)
    philly = [c for c in report["cases"] if c["group"] == "philly-256"]
    assert [c["name"] for c in philly] == ["philly-256-w1"]
    (case,) = philly
    assert case["role"] == "held-out" and case["gpus"] == 256
    assert case["philly"]["jobs"] == 1500 and case["philly"]["history_jobs"] > 0
    assert sum(case["philly"]["nominal"].values()) == 256
    check_case(case, POLICIES)


def test_tuning_cases_stay_out_of_the_held_out_summary(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    report = quality.main(
        ["--no-philly", "--families", "bursty", "--seeds", "2", "--family-jobs", "100",
         "--policies", "kueue-tas,berth", "--jobs", "1", "--out", str(out)],
        console=quiet(),
    )  # fmt: skip
    roles = {c["name"]: c["role"] for c in report["cases"]}
    assert roles == {"bursty-s0": "tuning", "bursty-s1": "held-out"}
    assert report["tuning"]["names"] == ["bursty-s0"]
    assert report["held_out"]["cases"] == 1 and report["tuning"]["cases"] == 1
    held = report["cases"][1]["versus_baseline"]["berth"]["avg_jct_s"]["value"]
    assert report["held_out"]["metrics"]["avg_jct_s"]["berth"]["median"] == held


def test_the_tuning_set_is_disjoint_from_the_held_out_one(tmp_path: Path) -> None:
    # --tuning runs where settings are chosen (seed 0 and 10-13, window 0); a default run's
    # held-out seeds (1 to 4) and windows (1 to 5) are none of them.
    args = quality.parse_args(["--tuning"])
    assert args.window_list == [0] and args.seed_list == [0, 10, 11, 12, 13]
    assert {c.role for c in quality.family_cases(args)} == {"tuning"}
    default = quality.parse_args([])
    held = [c.seed for c in quality.family_cases(default) if c.role == "held-out"]
    assert held and not set(held) & set(args.seed_list)
    out = tmp_path / "t.json"
    report = quality.main(
        ["--tuning", "--no-philly", "--families", "bursty", "--family-jobs", "60",
         "--policies", "kueue-tas,berth", "--jobs", "1", "--out", str(out)],
        console=quiet(),
    )  # fmt: skip
    assert report["tuning"]["cases"] == 5 and report["held_out"]["cases"] == 0
    assert "## Tuning cases (5): where settings are chosen" in out.with_suffix(".md").read_text()


def test_comparisons_with_the_baseline() -> None:
    jct = next(m for m in quality.METRICS if m.key == "avg_jct_s")
    jain = next(m for m in quality.METRICS if m.key == "jain_fairness")
    goodput = next(m for m in quality.METRICS if m.key == "goodput")
    assert quality.compare(jct, 80.0, 100.0) == (0.8, True)
    assert quality.compare(jct, 120.0, 100.0) == (1.2, False)
    assert quality.compare(jct, 0, 0) == (1.0, True)
    assert quality.compare(jct, 5, 0) == (None, False)  # no ratio, still a loss
    assert quality.compare(jct, None, 100.0) == (None, None)
    assert quality.compare(jain, 0.8, 0.9) == (-0.1, False)
    assert quality.compare(goodput, 0.6, 0.5) == (1.2, True)


# A big job admitted, preempted and admitted again; a small one; a big one still running.
BIG_JOB_EVENTS = [
    {"t": 0, "type": "submit", "job": "big", "gpus": 16},
    {"t": 0, "type": "submit", "job": "small", "gpus": 8},
    {"t": 0, "type": "submit", "job": "late", "gpus": 32},
    {"t": 5, "type": "admit", "job": "small"},
    {"t": 10, "type": "admit", "job": "big"},
    {"t": 20, "type": "preempt", "job": "big"},
    {"t": 90, "type": "admit", "job": "big"},
    {"t": 100, "type": "finish", "job": "big"},
    {"t": 100, "type": "admit", "job": "late"},  # still running at the end
]


def test_p99_first_wait_of_big_jobs_reads_the_first_admission() -> None:
    # big waited 10 s, late 100 s: the p99 (linear) of the two.
    assert quality.big_job_p99_first_wait(BIG_JOB_EVENTS) == 99.1
    assert quality.big_job_p99_first_wait(BIG_JOB_EVENTS[:5]) == 10.0
    assert quality.big_job_p99_first_wait(BIG_JOB_EVENTS[1:4]) is None


def test_the_total_wait_and_jct_of_big_jobs_count_every_wait() -> None:
    # Of finished big jobs only (late is not): big waited 10 s, then 70 s.
    figures = quality.big_job_figures(BIG_JOB_EVENTS)
    assert figures == {"avg_jct_big_s": 100.0, "p99_total_wait_big_s": 80.0}
    assert quality.big_job_figures(BIG_JOB_EVENTS[1:2]) == {
        "avg_jct_big_s": None,
        "p99_total_wait_big_s": None,
    }


def test_checkpoints_reach_every_policy_and_the_report(tmp_path: Path) -> None:
    """--checkpoint-s: preempted work resumes, so a policy loses less of it than without."""
    case = next(c for c in quality.family_cases(quality.parse_args(["--quick"])))
    base = quality.run_one(case, "kueue-tas")
    kept = quality.run_one(case, "kueue-tas", checkpoint_s=60.0)
    assert base["preemptions"] > 0  # or the comparison below says nothing
    assert kept["gpu_hours_lost_to_preemption"] < base["gpu_hours_lost_to_preemption"]
    out = tmp_path / "q.json"
    argv = ["--quick", "--no-philly", "--families", "gangs", "--checkpoint-s", "600"]
    report = quality.main([*argv, "--policies", "kueue-tas,berth", "--out", str(out)], quiet())
    assert report["config"]["checkpoint_s"] == 600.0
    md = out.with_suffix(".md").read_text()
    assert "--checkpoint-s 600`" in md and "checkpoints every 600 s" in md
    with pytest.raises(SystemExit):
        quality.parse_args(["--checkpoint-s", "0"])
