"""Held-out Philly windows (`scheduling.simulator.windows`): where they are, their quotas."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest
from shared_data import philly_dir

from scheduling.config import load_cluster
from scheduling.simulator.philly import import_philly
from scheduling.simulator.trace import TraceJob, load_trace
from scheduling.simulator.windows import (
    HISTORY_S,
    history_quotas,
    make_windows,
    philly_cluster,
    window_starts,
)

DAY = 86_400.0


def job(i: int, t: float, team: str, gpus: int = 1, duration: float = 3600.0) -> TraceJob:
    return TraceJob(f"j{i:05d}", t, team, 1, gpus, duration)


def steady_trace(n: int = 1000, days: float = 100.0) -> list[TraceJob]:
    """n jobs evenly over `days`, teams a, b, c in turn."""
    return [job(i, i * days * DAY / n, "abc"[i % 3]) for i in range(n)]


def test_windows_are_consecutive_jobs_shifted_to_start_at_zero() -> None:
    trace = steady_trace()
    windows = make_windows(trace, 64, windows=4, size=100)
    assert len(windows) == 4
    for w in windows:
        original = trace[w.first : w.first + 100]
        assert [j.job_id for j in w.jobs] == [j.job_id for j in original]
        assert w.jobs[0].submit_time == 0.0
        assert w.offset_s == original[0].submit_time
        for shifted, before in zip(w.jobs, original, strict=True):
            assert shifted.submit_time == pytest.approx(before.submit_time - w.offset_s)
            assert replace(shifted, submit_time=before.submit_time) == before


def test_windows_are_spread_evenly_from_the_first_job_to_the_last() -> None:
    starts = window_starts(1000, 4, 100)
    assert starts[0] == 0 and starts[-1] == 900  # the last window ends with the trace
    gaps = [b - a for a, b in pairwise(starts)]
    assert max(gaps) - min(gaps) <= 1
    assert window_starts(82_247, 6, 6000) == [0, 15249, 30499, 45748, 60998, 76247]
    with pytest.raises(ValueError, match="does not fit"):
        window_starts(50, 2, 100)


def test_quotas_come_only_from_the_30_days_before_the_window() -> None:
    # Team c ran long ago, team a in the last month, team b only in the window and after it.
    # The window's quotas must follow last month: a most, b the floor of 1, c nothing.
    old = [job(i, i * 10.0, "c", gpus=8) for i in range(50)]
    recent = [job(100 + i, 60 * DAY + i * 60.0, "a") for i in range(50)]
    window = [job(200 + i, 80 * DAY + i * 60.0, "b") for i in range(100)]
    later = [job(400 + i, 90 * DAY + i * 60.0, "b", gpus=8) for i in range(100)]
    w = make_windows(old + recent + window + later, 16, windows=3, size=100)[1]
    assert w.first == 100 and w.jobs[0].job_id == "j00200"
    assert w.role == "held-out"
    assert w.history_jobs == 50  # `recent` only: `old` is more than 30 days before
    assert w.nominal == {"a": 15, "b": 1}  # c: neither in the window nor in its history

    # The window's own jobs and the jobs after it change nothing.
    heavier = [replace(j, gpus_per_replica=8, duration=1e6) for j in window]
    relabeled = [replace(j, team="a") for j in later]
    changed = make_windows(old + recent + heavier + relabeled, 16, windows=3, size=100)[1]
    assert changed.nominal == w.nominal and changed.history_jobs == w.history_jobs


def test_quotas_are_largest_remainder_of_history_gpu_time_after_one_gpu_each() -> None:
    history = [job(0, 0, "a", gpus=3), job(1, 0, "b", gpus=1)]
    # 1 GPU each first, then the other 8 split 3:1 -> 6 and 2
    assert history_quotas(history, {"a", "b"}, 10) == {"a": 7, "b": 3}
    # 8 over 3:3:1 is 3.43, 3.43, 1.14: floors 3, 3, 1, and the one left goes to the first of
    # the tied largest remainders
    history3 = [job(0, 0, "a", gpus=3), job(1, 0, "b", gpus=3), job(2, 0, "c", gpus=1)]
    quotas = history_quotas(history3, set(), 8)
    assert quotas == {"a": 4, "b": 3, "c": 1} and sum(quotas.values()) == 8


def test_a_team_with_no_history_still_gets_one_gpu() -> None:
    history = [job(i, 0, "big", gpus=8, duration=1e6) for i in range(10)]
    quotas = history_quotas(history, {"big", "newcomer"}, 64)
    assert quotas["newcomer"] >= 1
    assert sum(quotas.values()) == 64
    # No history at all (the first window): an even split over the window's teams.
    assert history_quotas([], {"x", "y", "z"}, 9) == {"x": 3, "y": 3, "z": 3}
    with pytest.raises(ValueError, match="cannot give each"):
        history_quotas([], {"x", "y", "z"}, 2)


def test_every_window_quota_sums_to_the_cluster_and_covers_its_teams() -> None:
    trace = [*steady_trace(3000), job(9999, 100 * DAY, "late")]
    for w in make_windows(trace, 32, windows=5, size=500):
        assert sum(w.nominal.values()) == 32
        teams = w.teams()
        assert all(teams[j.team].nominal.gpu >= 1000 for j in w.jobs)
        assert w.role == ("tuning" if w.index == 0 else "held-out")


def test_philly_cluster_is_the_one_the_importer_writes(tmp_path: Path) -> None:
    src = tmp_path / "philly.csv"
    src.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-01 00:00:00,60,1,60,vc\n")
    imported = import_philly(src, 64, tmp_path / "out", show_progress=False)
    written = load_cluster(imported.cluster_path)
    ours = philly_cluster(64)
    assert ours.levels == written.levels and ours.slowdown == written.slowdown
    assert [(n.name, n.gpus, n.groups, n.domains) for n in ours.nodes] == [
        (n.name, n.gpus, n.groups, n.domains) for n in written.nodes
    ]


def test_windows_of_the_philly_trace(tmp_path: Path) -> None:
    imported = import_philly(philly_dir(), 256, tmp_path, show_progress=False)
    trace = load_trace(imported.jobs_path)
    windows = make_windows(trace, 256)
    assert [w.role for w in windows] == ["tuning"] + ["held-out"] * 5
    for w in windows:
        assert len(w.jobs) == 6000 and sum(w.nominal.values()) == 256
        assert w.offset_s - w.history_from_s <= HISTORY_S
        if w.history_jobs:
            before = trace[w.first - w.history_jobs : w.first]
            assert all(w.offset_s - HISTORY_S <= j.submit_time <= w.offset_s for j in before)
