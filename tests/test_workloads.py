"""Synthetic workload families (`scheduling.simulator.workloads`): seeded, valid, as claimed."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from scheduling.admission import check_job
from scheduling.simulator.baselines import get_policy
from scheduling.simulator.sim import simulate, to_job
from scheduling.simulator.trace import TraceJob
from scheduling.simulator.workloads import FAMILIES, Workload, build, offered_load

N = 600


def gpus(j: TraceJob) -> float:
    return j.replicas * j.gpus_per_replica


@pytest.fixture(scope="module")
def workloads() -> dict[str, list[Workload]]:
    """Three seeds of every family (seed 0 is the tuning one, the others held out)."""
    return {name: [build(name, seed, N) for seed in (0, 1, 2)] for name in FAMILIES}


def test_the_same_seed_gives_the_same_workload_and_another_seed_another() -> None:
    for name in FAMILIES:
        a, b, c = build(name, 3, 200), build(name, 3, 200), build(name, 4, 200)
        assert a.jobs == b.jobs and a.teams == b.teams
        assert [n.name for n in a.cluster.nodes] == [n.name for n in b.cluster.nodes]
        assert a.jobs != c.jobs


def test_every_job_is_accepted_with_quotas(workloads: dict[str, list[Workload]]) -> None:
    for name, cases in workloads.items():
        for w in cases:
            assert len(w.jobs) == N
            assert all(j.team in w.teams for j in w.jobs)
            problems = [
                (j.job_id, r.message)
                for j in w.jobs
                if (r := check_job(to_job(j), w.cluster, w.teams, quotas=True)) is not None
            ]
            assert problems == [], name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_queues_form_but_the_case_stays_small(family: str) -> None:
    w = build(family, 1, 150)
    load = offered_load(w.cluster, w.jobs)
    lo, hi = FAMILIES[family].load
    assert 0.9 <= lo <= load["dominant"] * 1.01 and load["dominant"] <= hi * 1.01 <= 1.32
    result = simulate(w.cluster, w.teams, w.jobs, get_policy("kueue-tas"))
    kinds = Counter(e["type"] for e in result.events)
    assert kinds["reject"] == 0 and result.unfinished == 0
    assert kinds["finish"] == 150


def test_default_size_loads_are_within_the_range(workloads: dict[str, list[Workload]]) -> None:
    for name, cases in workloads.items():
        lo, hi = FAMILIES[name].load
        loads = [offered_load(w.cluster, w.jobs)["dominant"] for w in cases]
        assert all(lo * 0.99 <= x <= hi * 1.01 for x in loads), (name, loads)
        assert len({round(x, 3) for x in loads}) == 3  # each seed draws its own load


def test_fractional_is_shares_and_cpu_bound(workloads: dict[str, list[Workload]]) -> None:
    for w in workloads["fractional"]:
        assert len(w.cluster.nodes) == 8 and {n.gpus for n in w.cluster.nodes} == {4}
        assert {n.cpu for n in w.cluster.nodes} == {16_000}  # 4 CPUs per GPU
        shared = np.mean([j.gpus_per_replica < 1 for j in w.jobs])
        assert 0.33 <= shared <= 0.47
        load = offered_load(w.cluster, w.jobs)
        assert load["cpu"] > load["gpu"]  # CPUs run out before GPUs do
        assert load["dominant"] >= 1.0


def test_gangs_are_many_and_held_to_a_domain(workloads: dict[str, list[Workload]]) -> None:
    for w in workloads["gangs"]:
        assert w.cluster.levels == ("block", "rack")
        gangs = [j for j in w.jobs if j.replicas > 1]
        assert len(gangs) / len(w.jobs) >= 0.45
        assert {gpus(j) for j in gangs} == {8, 16, 32, 64}
        assert {j.topology for j in gangs} == {"node", "rack", "block"}
        multi_node = [j for j in gangs if gpus(j) >= 16]
        assert len(multi_node) / len(w.jobs) >= 0.3
        gang_work = sum(gpus(j) * j.duration for j in gangs)
        assert gang_work / sum(gpus(j) * j.duration for j in w.jobs) >= 0.8


def test_priorities_mix_levels_and_pin_some_jobs(workloads: dict[str, list[Workload]]) -> None:
    for w in workloads["priorities"]:
        for team in w.teams:
            levels = Counter(j.priority for j in w.jobs if j.team == team)
            assert len(levels) >= 3, team
        pinned = [j for j in w.jobs if not j.preemptible]
        assert 0.05 <= len(pinned) / len(w.jobs) <= 0.2
        # A non-preemptible job may not borrow: it fits in its team's nominal.
        assert all(gpus(j) * 1000 <= w.teams[j.team].nominal.gpu for j in pinned)


def test_bursty_arrivals_come_in_bursts(workloads: dict[str, list[Workload]]) -> None:
    for w in workloads["bursty"]:
        t = np.array([j.submit_time for j in w.jobs])
        counts, _ = np.histogram(t, bins=64)
        assert np.mean(counts == 0) >= 0.4  # the off periods
        assert counts.var() / counts.mean() > 5  # Poisson arrivals would give about 1
        # Each team bursts too, not only the sum of them.
        for team in w.teams:
            mine, _ = np.histogram([j.submit_time for j in w.jobs if j.team == team], bins=64)
            assert np.mean(mine == 0) >= 0.4


def test_skewed_has_one_big_team_and_heavy_borrowers(
    workloads: dict[str, list[Workload]],
) -> None:
    for w in workloads["skewed"]:
        nominal = {t: team.nominal.gpu / 1000 for t, team in w.teams.items()}
        big = max(nominal, key=nominal.__getitem__)
        assert nominal[big] >= 0.7 * sum(nominal.values())
        span = w.jobs[-1].submit_time - w.jobs[0].submit_time
        asked = {
            t: sum(gpus(j) * j.duration for j in w.jobs if j.team == t) / span for t in nominal
        }
        small = [t for t in nominal if t != big]
        # They live on borrowed GPUs: each asks for more than its nominal, all together twice.
        assert all(asked[t] >= 1.25 * nominal[t] for t in small)
        assert sum(asked[t] for t in small) >= 2 * sum(nominal[t] for t in small)
        first_big = min(j.submit_time for j in w.jobs if j.team == big)
        assert first_big >= 0.3 * span  # the lender comes back for its quota


def test_long_short_is_heavy_tailed(workloads: dict[str, list[Workload]]) -> None:
    for w in workloads["long-short"]:
        d = np.array([j.duration for j in w.jobs])
        assert 2 <= np.sum(d >= 2 * 86_400) <= 0.03 * len(d)  # a few multi-day jobs
        assert np.median(d) < 3600
        assert np.percentile(d, 99) / np.median(d) > 50


def test_an_unknown_family_is_named() -> None:
    with pytest.raises(KeyError, match="choose one of: fractional"):
        build("nope", 0)
    with pytest.raises(ValueError, match="at least 10 jobs"):
        build("gangs", 0, 5)


def test_gangs_limits_has_the_jobs_of_gangs_with_limits_no_run_reaches() -> None:
    plain, limited = build("gangs", 2, N), build("gangs-limits", 2, N)
    strip = [replace(j, time_limit_s=None) for j in limited.jobs]
    assert strip == plain.jobs  # the workload held fixed: only the limits differ
    worst = max(plain.cluster.slowdown.values())
    need = np.array([(j.duration + 60.0) * worst for j in plain.jobs])
    limits = np.array([j.time_limit_s for j in limited.jobs])
    assert (limits >= need).all()  # a restart at the slowest level still ends in time
    ratio = need / limits
    assert 0.2 < float(np.median(ratio)) < 0.7  # users overestimate, about 2x at the median
    assert len(set(limits.tolist())) <= 20  # round numbers, as users pick them
