"""bench/case_teams.py: per-team figures of one quality case, from a simulation's events."""

from __future__ import annotations

import pytest

from bench import case_teams


def test_team_figures_count_each_teams_jobs_and_idle_gpus_while_a_job_fits() -> None:
    events = [
        {"t": 0.0, "type": "submit", "job": "a", "team": "x", "gpus": 4.0},
        {"t": 0.0, "type": "admit", "job": "a"},
        {"t": 0.0, "type": "submit", "job": "b", "team": "y", "gpus": 2.0},
        # 10 s: b waits for 2 GPUs while 4 of 8 are idle -> 40 GPU-s
        {"t": 10.0, "type": "admit", "job": "b"},
        {"t": 20.0, "type": "preempt", "job": "b"},
        # 20-30 s: b waits again, 4 idle -> 40 GPU-s more
        {"t": 30.0, "type": "admit", "job": "b"},
        {"t": 40.0, "type": "finish", "job": "a"},
        {"t": 50.0, "type": "finish", "job": "b"},
    ]
    out = case_teams.team_figures(events, total_gpus=8)
    assert out["teams"] == {
        "x": {"jobs": 1, "avg_jct_s": 40.0, "avg_first_wait_s": 0.0},
        "y": {"jobs": 1, "avg_jct_s": 50.0, "avg_first_wait_s": 10.0},
    }
    assert out["idle_gpu_hours_while_a_job_fits"] == pytest.approx(80 / 3600)


def test_a_small_family_case_runs_and_a_bad_name_says_which_forms_exist() -> None:
    out = case_teams.main(["skewed-s1", "--policies", "berth,fifo-backfill", "--family-jobs", "60"])
    assert set(out["policies"]) == {"berth", "fifo-backfill"}
    for figures in out["policies"].values():
        assert sum(t["jobs"] for t in figures["teams"].values()) == out["jobs"] == 60
    with pytest.raises(ValueError, match="philly-<gpus>-w<window> nor <family>-s<seed>"):
        case_teams.find_case("nonsense-w1")
