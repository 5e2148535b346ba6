"""The SRTF oracle (`scheduling.simulator.oracle`): hand-worked cases and a naive reference."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from scheduling.simulator.oracle import srtf
from scheduling.simulator.trace import TraceJob


def job(name: str, t: float, gpus: float, duration: float, replicas: int = 1) -> TraceJob:
    return TraceJob(name, t, "t", replicas, gpus, duration)


def times(result: object, name: str) -> tuple[float, float, int]:
    i = result.job_ids.index(name)  # type: ignore[attr-defined]
    return (
        float(result.start[i]),  # type: ignore[attr-defined]
        float(result.finish[i]),  # type: ignore[attr-defined]
        int(result.preempted[i]),  # type: ignore[attr-defined]
    )


def test_a_shorter_arrival_preempts_the_long_job() -> None:
    # 4 GPUs. A (4 GPUs, 100 s) starts at 0; B (4 GPUs, 10 s) arrives at 20 with less left
    # (10 < 80), so A stops, B runs 20-30, A resumes with 80 s left and ends at 110.
    r = srtf([job("A", 0, 4, 100), job("B", 20, 4, 10)], 4)
    assert times(r, "A") == (0.0, 110.0, 1)
    assert times(r, "B") == (20.0, 30.0, 0)
    s = r.summary()
    assert s["avg_jct_s"] == 60.0  # (110 + 10) / 2
    assert s["avg_first_wait_s"] == 0.0
    assert s["avg_total_wait_s"] == 5.0  # A waited 10 s while B ran
    assert s["preemptions"] == 1 and s["makespan_s"] == 110.0


def test_a_job_too_wide_for_what_is_left_is_skipped_not_blocking() -> None:
    # 4 GPUs. A (3 GPUs, 10 s) runs from 0. At 1, B (4 GPUs, 20 s) is ahead of C (1 GPU,
    # 15 s) in the list but does not fit in the 1 GPU left: C runs at once. At 10 A ends:
    # C (6 s left) is ahead of B and takes 1 GPU, B does not fit in 3 and waits for C (16).
    r = srtf([job("A", 0, 3, 10), job("B", 1, 4, 20), job("C", 1, 1, 15)], 4)
    assert times(r, "A") == (0.0, 10.0, 0)
    assert times(r, "C") == (1.0, 16.0, 0)
    assert times(r, "B") == (16.0, 36.0, 0)


def test_a_wide_job_ahead_takes_the_pool_back() -> None:
    # The same, but C needs 30 s: at 10 B (20 s) is ahead of C (21 s left) and fits in the
    # empty pool, so C is preempted until B ends at 30, then finishes its 21 s at 51.
    r = srtf([job("A", 0, 3, 10), job("B", 1, 4, 20), job("C", 1, 1, 30)], 4)
    assert times(r, "B") == (10.0, 30.0, 0)
    assert times(r, "C") == (1.0, 51.0, 1)


def test_shares_of_a_gpu_run_together_and_gangs_count_whole() -> None:
    shares = [job(f"s{i}", 0, 0.25, 10) for i in range(4)]
    gang = job("g", 0, 2, 5, replicas=2)  # 4 GPUs at once: not before the shares end
    r = srtf([*shares, gang], 4)
    # By remaining time: g (5 s) first takes all 4 GPUs, the shares wait for it.
    assert times(r, "g") == (0.0, 5.0, 0)
    assert all(times(r, f"s{i}") == (5.0, 15.0, 0) for i in range(4))
    r1 = srtf(shares, 1)
    assert all(times(r1, f"s{i}") == (0.0, 10.0, 0) for i in range(4))


def test_a_job_wider_than_the_pool_never_runs_and_blocks_nothing() -> None:
    r = srtf([job("huge", 0, 16, 1), job("small", 0, 1, 5)], 8)
    assert math.isnan(r.start[0]) and math.isnan(r.finish[0])
    assert times(r, "small") == (0.0, 5.0, 0)
    s = r.summary()
    assert s["unrunnable"] == 1 and s["finished"] == 1 and s["avg_jct_s"] == 5.0


def test_completions_come_before_arrivals_at_one_instant() -> None:
    r = srtf([job("A", 0, 1, 10), job("B", 10, 1, 50)], 1)
    assert times(r, "B") == (10.0, 60.0, 0)  # A's GPU was free at 10: no wait


def test_summary_follows_the_metrics_definitions() -> None:
    trace = [job("a", 0, 1, 10), job("b", 0, 1, 20), job("c", 5, 1, 5)]
    r = srtf(trace, 1)
    jct = r.finish - r.submit
    s = r.summary()
    assert s["avg_jct_s"] == pytest.approx(jct.mean(), abs=1e-3)  # rounded to 3 decimals
    assert s["p99_jct_s"] == pytest.approx(np.percentile(jct, 99), abs=1e-3)
    assert s["avg_first_wait_s"] == pytest.approx((r.start - r.submit).mean(), abs=1e-3)
    assert s["avg_total_wait_s"] == pytest.approx((jct - r.duration).mean(), abs=1e-3)


def naive_srtf(trace: list[TraceJob], gpus: float) -> tuple[list[float], list[float], list[int]]:
    """The definition, literally: after every instant with events, sort every job by remaining
    time and go down the list."""
    cap = round(gpus * 1000)
    size = [round(j.replicas * j.gpus_per_replica * 1000) for j in trace]
    rem = [j.duration for j in trace]
    n = len(trace)
    start, finish = [math.nan] * n, [math.nan] * n
    preempted = [0] * n
    arrivals = sorted((i for i in range(n) if size[i] <= cap), key=lambda i: trace[i].submit_time)
    running: dict[int, float] = {}
    waiting: set[int] = set()
    a = 0
    while a < len(arrivals) or running:
        next_arrival = trace[arrivals[a]].submit_time if a < len(arrivals) else math.inf
        now = min(next_arrival, min(running.values(), default=math.inf))
        for done in [j for j, f in running.items() if f <= now]:
            del running[done]
            finish[done] = now
        while a < len(arrivals) and trace[arrivals[a]].submit_time <= now:
            waiting.add(arrivals[a])
            a += 1
        active = [(running[j] - now, j) for j in running] + [(rem[j], j) for j in waiting]
        free, chosen = cap, set()
        for _, j in sorted(active):
            if size[j] <= free:
                chosen.add(j)
                free -= size[j]
        for j in [j for j in running if j not in chosen]:
            rem[j] = running.pop(j) - now
            preempted[j] += 1
            waiting.add(j)
        for j in chosen - running.keys():
            waiting.discard(j)
            if math.isnan(start[j]):
                start[j] = now
            running[j] = now + rem[j]
    return start, finish, preempted


def random_trace(rng: random.Random, n: int) -> list[TraceJob]:
    t, out = 0, []
    for i in range(n):
        t += rng.choice([0, 0, 1, 2, 5, 10, 30])  # whole seconds: sums are exact
        gpus = rng.choice([1, 1, 1, 2, 3, 4, 8, 0.5, 0.25])
        replicas = 1 if gpus < 1 else rng.choice([1, 1, 2])
        out.append(job(f"j{i}", float(t), gpus, float(rng.randint(1, 100)), replicas))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_definition_on_random_cases(seed: int) -> None:
    rng = random.Random(seed)
    gpus = rng.choice([1, 2, 4, 8, 16])
    for _ in range(10):
        trace = random_trace(rng, rng.randint(1, 60))
        start, finish, preempted = naive_srtf(trace, gpus)
        r = srtf(trace, gpus)
        np.testing.assert_array_equal(r.start, start)
        np.testing.assert_array_equal(r.finish, finish)
        assert list(r.preempted) == preempted


def test_six_thousand_jobs_on_a_crowded_pool_are_fast() -> None:
    # Philly-like: mostly 1 GPU, a few wide jobs, arrivals faster than 256 GPUs can serve.
    rng = np.random.default_rng(0)
    n = 6000
    sizes = rng.choice(
        [1, 2, 4, 8, 16, 32, 64], size=n, p=[0.8, 0.06, 0.05, 0.05, 0.02, 0.01, 0.01]
    )
    durations = np.round(rng.lognormal(np.log(1800), 1.5, n)) + 1
    submits = np.cumsum(rng.exponential(20.0, n))
    trace = [
        job(f"j{i}", float(submits[i]), float(sizes[i]), float(durations[i])) for i in range(n)
    ]
    started = time.perf_counter()
    r = srtf(trace, 256)
    elapsed = time.perf_counter() - started
    assert r.summary()["finished"] == n and r.summary()["preemptions"] > 0
    # About 0.5 s on our 2-core machine; the bound catches a return to a full pass per event
    # (minutes), not noise.
    assert elapsed < 15.0
