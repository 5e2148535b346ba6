"""Quotas: nominal, borrowing and lending in one cohort; rejection of what can never run."""

from __future__ import annotations

import pytest
from builders import World, admitted, cluster, job, teams
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.admission import check_job
from scheduling.config import ConfigError, parse_cluster, parse_teams
from scheduling.decisions import Reason
from scheduling.quota import QuotaLedger, QuotaProblem, Team
from scheduling.resources import Resources


def test_team_borrows_idle_quota_up_to_its_borrowing_limit():
    w = World(cluster(nodes=2, gpus=8), teams(a={"nominal": 4, "borrowing_limit": 4}, b=12))
    w.submit(*[job(f"a{i}", "a", gpus=2) for i in range(5)])
    res = w.cycle()
    assert len(admitted(res)) == 4  # 8 GPUs = nominal 4 + borrowing limit 4
    reason = res.reason_for(w.state.pending["a4"])
    assert reason.code == Reason.QUOTA and reason.resource == "gpus"
    assert "borrowing_limit" in reason.message


def test_lending_limit_caps_what_others_may_borrow():
    w = World(cluster(nodes=2, gpus=8), teams(a=4, b={"nominal": 12, "lending_limit": 2}))
    w.submit(*[job(f"a{i}", "a", gpus=1) for i in range(10)])
    w.cycle()
    assert len(w.running()) == 6  # own 4 + the 2 that b lends (a lends all of its own)
    assert w.state.quota.usage["a"].gpu == 6000


def test_non_preemptible_job_may_not_borrow():
    w = World(cluster(nodes=1, gpus=8), teams(a=2, b=6))
    w.submit(
        job("safe", "a", gpus=2, preemptible=False), job("more", "a", gpus=1, preemptible=False)
    )
    res = w.cycle()
    assert admitted(res) == ["safe"]
    reason = res.reason_for(w.state.pending["more"])
    assert reason.code == Reason.QUOTA and "non-preemptible" in reason.message


def test_ledger_pool_accounting_is_exact():
    tm = teams(a={"nominal": 10, "lending_limit": 2}, b=10)
    assert QuotaLedger(tm).pool_capacity.gpu == 12_000  # a lends 2, b lends all 10
    q2 = QuotaLedger(tm)
    q2.add("b", Resources.of(12))
    assert q2.check("b", Resources.of(1)).limit == "cohort"
    q2.add("a", Resources.of(8))  # a uses only its guaranteed part: pool untouched
    assert q2.pool_used.gpu == 12_000
    assert q2.check("a", Resources.of(1)).limit == "cohort"  # a's 9th GPU is lendable, lent
    q2.remove("b", Resources.of(12))
    assert q2.pool_used.gpu == 0 and q2.usage["b"].gpu == 0
    assert q2.check("a", Resources.of(2)) is None


def _reference_check(
    teams: dict[str, Team], usage: dict[str, Resources], team: str, r: Resources, preemptible: bool
) -> QuotaProblem | None:
    """The quota rules written plainly, resource by resource, with no shortcuts."""
    t = teams[team]
    after = usage[team] + r
    over = after.first_excess(t.ceiling)
    if over:
        return QuotaProblem(over, "borrowing_limit")
    over = None if preemptible else after.first_excess(t.nominal)
    if over:
        return QuotaProblem(over, "nominal_non_preemptible")
    for name, attr in (("gpus", "gpu"), ("cpus", "cpu"), ("memory_gb", "mem")):

        def draw(team_name: str, used: Resources, a: str = attr) -> int:
            return max(getattr(used, a) - getattr(teams[team_name].guaranteed, a), 0)

        pool_after = sum(draw(n, after if n == team else u) for n, u in usage.items())
        lent = sum(getattr(x.lending_limit, attr) for x in teams.values())
        if draw(team, after) > draw(team, usage[team]) and pool_after > lent:
            return QuotaProblem(name, "cohort")
    return None


amounts = st.builds(
    Resources,
    st.integers(0, 6).map(lambda g: g * 1000),
    st.integers(0, 64).map(lambda c: c * 1000),
    st.integers(0, 512).map(lambda m: m * 1024),
)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), amounts, st.booleans()), max_size=30))
def test_ledger_agrees_with_the_plain_rules(steps: list) -> None:
    nominal = {"gpus": 4, "cpus": 32, "memory_gb": 256}
    tm = parse_teams(
        [
            {"name": "a", "nominal": nominal, "lending_limit": {"gpus": 2, "cpus": 8}},
            {"name": "b", "nominal": nominal, "borrowing_limit": {"gpus": 4, "memory_gb": 64}},
            {"name": "c", "nominal": {"gpus": 2, "cpus": 16}},
        ]
    )
    q = QuotaLedger(tm)
    usage = {name: Resources() for name in tm}
    for team, r, preemptible in steps:
        problem = q.check(team, r, preemptible)
        assert problem == _reference_check(tm, usage, team, r, preemptible)
        if problem is None:
            q.add(team, r)
            usage[team] = usage[team] + r
        elif usage[team].gpu >= r.gpu and usage[team].cpu >= r.cpu and usage[team].mem >= r.mem:
            q.remove(team, r)  # give something back now and then
            usage[team] = usage[team] - r
        assert q.usage == usage
        assert q.borrowers == {n for n, u in usage.items() if not u.fits_in(tm[n].nominal)}


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), amounts), max_size=12),
    st.sampled_from("abc"),
    amounts,
    amounts,
    st.booleans(),
)
def test_fits_after_release_is_check_on_the_ledger_without_the_release(
    steps: list, team: str, request: Resources, release: Resources, preemptible: bool
) -> None:
    # The preemption search's quota bound: `fits_after_release` must say what a clone with the
    # team's usage lowered says, or a bound that skips searches would skip one that succeeds.
    tm = parse_teams(
        [
            {"name": "a", "nominal": {"gpus": 4, "cpus": 32}, "lending_limit": {"gpus": 2}},
            {"name": "b", "nominal": {"gpus": 4}, "borrowing_limit": {"gpus": 3}},
            {"name": "c", "nominal": {"gpus": 2, "cpus": 16, "memory_gb": 128}},
        ]
    )
    q = QuotaLedger(tm)
    for t, r in steps:
        if q.check(t, r) is None:
            q.add(t, r)
    u = q.usage[team]
    release = Resources(min(release.gpu, u.gpu), min(release.cpu, u.cpu), min(release.mem, u.mem))
    given_back = q.clone()
    given_back.remove(team, release)
    expected = given_back.check(team, request, preemptible) is None
    assert q.fits_after_release(team, request, preemptible, release) == expected


@pytest.mark.parametrize(
    ("j", "field", "words"),
    [
        (job("x", "nobody"), "team", "unknown team"),
        (job("x", gpus=4, replicas=3, topology="node"), "replicas", "any one node"),
        (job("x", gpus=9), "gpus_per_replica", "does not fit"),
        (job("x", gpus=1, topology="rack"), "topology", "not a level"),
        (job("x", gpus=2, replicas=8), "replicas", "may hold at most"),
        (job("x", gpus=1.5), "gpus_per_replica", "whole number"),
        (job("x", gpus=3, preemptible=False), "replicas", "may not borrow"),
    ],
)
def test_jobs_that_can_never_run_are_rejected_naming_the_field(j, field, words):
    cl = cluster(nodes=2, gpus=8)
    tm = teams(a={"nominal": 2, "borrowing_limit": 10}, b=14)
    rejection = check_job(j, cl, tm)
    assert rejection is not None
    assert rejection.field == field
    assert words in rejection.message


def test_feasible_job_is_not_rejected_even_if_it_must_wait():
    cl = cluster(nodes=2, gpus=8)
    assert check_job(job("x", gpus=8, replicas=2), cl, teams(a=16)) is None


def test_config_errors_name_the_field_and_the_fix():
    with pytest.raises(ConfigError) as e:
        parse_cluster({"node_pools": [{"prefix": "n", "count": 0, "gpus": 8}]})
    assert "node_pools.0.count" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_cluster({"node_pools": [{"prefix": "n", "count": 1, "gpus": 8, "gpu_groups": 3}]})
    assert "gpu_groups" in str(e.value) and "divisor" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_cluster({"topology_levels": ["rack"], "nodes": [{"name": "x", "gpus": 1}]})
    assert "labels" in str(e.value) and "rack" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_teams([{"name": "a", "nominal": {"gpus": 1}}, {"name": "a", "nominal": {}}])
    assert "unique" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_teams([{"name": "a", "nominal": {"gpus": 1}, "lending_limit": {"gpus": 2}}])
    assert "lending_limit" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_teams([{"name": "a", "nominal": {"gpus": -1}}])
    assert "nominal.gpus" in str(e.value)


def test_explicit_nodes_with_labels_build_the_topology_tree():
    cl = parse_cluster(
        {
            "topology_levels": ["block", "rack"],
            "nodes": [
                {
                    "name": "a",
                    "gpus": 4,
                    "gpu_groups": [[0, 1], [2, 3]],
                    "labels": {"block": "b1", "rack": "r1"},
                },
                {"name": "b", "gpus": 4, "labels": {"block": "b1", "rack": "r2"}},
            ],
        }
    )
    assert cl.order == ("gpu_group", "node", "rack", "block", "cluster")
    assert cl.domains["rack"] == {"r1": (0,), "r2": (1,)}
    assert cl.domains["block"] == {"b1": (0, 1)}
    assert cl.nodes[0].groups == (0b0011, 0b1100)
