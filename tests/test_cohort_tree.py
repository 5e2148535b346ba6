"""The organization tree (`cohorts:` in teams.yaml, Kueue's hierarchical cohorts): unused quota
is lent first inside the closest cohort, then further up, within every level's lending and
borrowing limits. The ledger is checked against Kueue's own formula for what a node may still
use, the engine and the audit on a replay, and the audit on a log that breaks a level."""

from __future__ import annotations

from typing import Any

import pytest
from builders import World, admitted, cluster, job
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.admission import check_job
from scheduling.cohorts import Cohort, cohort_pool, reachable, tree_excess
from scheduling.config import ConfigError, parse_teams
from scheduling.decisions import Reason
from scheduling.quota import QuotaLedger, Team
from scheduling.resources import UNLIMITED, ZERO, Resources
from scheduling.simulator.audit import audit, audit_or_raise
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.metrics import ClusterInfo, TeamInfo, summarize, team_infos
from scheduling.simulator.report import write_report
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import TraceJob

# research (lends at most 4 of its 16) holds nlp (a) and b; c sits at the root.
TREE = {
    "cohorts": [
        {"name": "research", "lending_limit": {"gpus": 4}},
        {"name": "nlp", "parent": "research"},
    ],
    "teams": [
        {"name": "a", "cohort": "nlp", "nominal": {"gpus": 8}},
        {"name": "b", "cohort": "research", "nominal": {"gpus": 8}},
        {"name": "c", "nominal": {"gpus": 8}},
    ],
}


def test_quota_is_lent_inside_the_closest_cohort_first_then_up_within_its_lending_limit() -> None:
    tm = parse_teams(TREE)
    research = tm["b"].cohorts[0]
    assert (research.quota.gpu, research.guaranteed.gpu, research.lends.gpu) == (16000, 12000, 4000)
    assert cohort_pool(tm).gpu == 12000  # research lends 4, c all of its 8
    assert reachable(tm["c"], tm).gpu == 12000  # c's 8 and the 4 research lends
    assert reachable(tm["a"], tm).gpu == 24000  # all of research's and c's
    q = QuotaLedger(tm)
    q.add("a", Resources.of(14))  # a borrows b's 6 idle GPUs inside research
    assert q.check("c", Resources.of(10)) is None  # research still lends 2 of its 4...
    assert q.check("c", Resources.of(11)).limit == "cohort"  # ... not 3
    q.add("c", Resources.of(10))
    # The 4 research lends sit in the root's pool, 2 drawn by a and 2 by c: b, below its
    # nominal, gets its last 2 GPUs back by reclaiming c's, as in Kueue.
    assert q.check("b", Resources.of(2)).limit == "cohort"
    q.remove("c", Resources.of(2))
    assert q.check("b", Resources.of(2)) is None


def test_a_cohorts_borrowing_limit_caps_what_its_subtree_takes_from_the_rest() -> None:
    tm = parse_teams(
        {
            "cohorts": [{"name": "vision", "borrowing_limit": {"gpus": 2}}],
            "teams": [
                {"name": "a", "cohort": "vision", "nominal": {"gpus": 4}},
                {"name": "b", "cohort": "vision", "nominal": {"gpus": 4}},
                {"name": "c", "nominal": {"gpus": 8}},
            ],
        }
    )
    w = World(cluster(nodes=2, gpus=8), tm)
    w.submit(*[job(f"a{i}", "a", gpus=1) for i in range(12)])
    res = w.cycle()
    assert len(admitted(res)) == 10  # vision's 8 and 2 borrowed from c: its limit
    reason = res.reason_for(w.state.pending["a10"])
    assert reason.code == Reason.QUOTA and "cohort vision" in reason.message
    assert "borrowing_limit" in reason.message


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"cohorts": [{"name": "x", "parent": "y"}]}, "parent 'y' is not a cohort"),
        (
            {"cohorts": [{"name": "x", "parent": "y"}, {"name": "y", "parent": "x"}]},
            "cycle: x -> y -> x",
        ),
        ({"cohorts": [{"name": "x"}], "cohort": "z"}, "cohort 'z' is not declared"),
        ({"cohorts": [{"name": "x"}, {"name": "lonely"}]}, "cohort lonely has no team"),
        ({"cohorts": [{"name": "a"}]}, "share the name 'a'"),
        ({"cohorts": [{"name": "x", "nominal": {"gpus.H100": 2}}]}, "a team's, not a cohort's"),
        ({"cohorts": [{"name": "x"}, {"name": "x"}]}, "cohort names must be unique"),
    ],
)
def test_a_bad_tree_is_refused_naming_what_to_fix(data: dict[str, Any], words: str) -> None:
    team = {"name": "a", "cohort": data.pop("cohort", "x"), "nominal": {"gpus": 1}}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        parse_teams({**data, "teams": [team]})


def _available(teams: dict[str, Team], usage: dict[str, Resources], team: str, attr: str) -> int:
    """Kueue's `available` (pkg/cache/hierarchy): what a node may still use, written the way
    Kueue writes it, node by node from the team up to the root, for one resource."""
    cohorts = {c.name: c for t in teams.values() for c in t.cohorts}

    def get(r: Resources) -> int:
        return getattr(r, attr)

    def node_usage(name: str | None) -> int:  # a cohort's (None: the root's): its children's draws
        total = 0
        for t in teams.values():
            parent = t.cohorts[0].name if t.cohorts else None
            if parent == name:
                total += max(0, get(usage[t.name]) - get(t.guaranteed))
        for c in cohorts.values():
            if c.parent == name:
                total += max(0, node_usage(c.name) - get(c.guaranteed))
        return total

    def available(quota: int, kept: int, used: int, borrow: int, parent: Cohort | None) -> int:
        if parent is None:  # below the root
            parent_available = get(cohort_pool(teams)) - node_usage(None)
        else:
            parent_available = available(
                get(parent.quota),
                get(parent.guaranteed),
                node_usage(parent.name),
                get(parent.borrowing_limit),
                cohorts[parent.parent] if parent.parent else None,
            )
        if borrow < UNLIMITED:
            parent_available = min(parent_available, quota - kept - max(0, used - kept) + borrow)
        return max(0, kept - used) + parent_available

    t = teams[team]
    return available(
        get(t.nominal),
        get(t.guaranteed),
        get(usage[team]),
        get(t.borrowing_limit),
        t.cohorts[0] if t.cohorts else None,
    )


def _maps(nominal: int, lend: int | None, borrow: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"nominal": {"gpus": nominal, "cpus": 16}}
    if lend is not None:
        out["lending_limit"] = {"gpus": min(lend, nominal)}
    if borrow is not None:
        out["borrowing_limit"] = {"gpus": borrow}
    return out


limits = st.one_of(st.none(), st.integers(0, 6))


@st.composite
def trees(draw: st.DrawFn) -> dict[str, Any]:
    """Two departments (one with a lab inside), a team in each cohort and one at the root,
    every quota and limit drawn; the cohorts' own nominal too."""
    cohorts = []
    for name, parent in (("dept1", None), ("lab", "dept1"), ("dept2", None)):
        c: dict[str, Any] = {"name": name}
        if parent:
            c["parent"] = parent
        own, lend, borrow = draw(st.integers(0, 4)), draw(limits), draw(limits)
        if own:
            c["nominal"] = {"gpus": own}
        if lend is not None:
            c["lending_limit"] = {"gpus": lend}
        if borrow is not None:
            c["borrowing_limit"] = {"gpus": borrow}
        cohorts.append(c)
    teams = []
    for name, cohort in (("a", "lab"), ("b", "dept1"), ("c", "dept2"), ("d", None)):
        t = {"name": name, **_maps(draw(st.integers(0, 8)), draw(limits), draw(limits))}
        if cohort:
            t["cohort"] = cohort
        teams.append(t)
    return {"cohorts": cohorts, "teams": teams}


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    trees(),
    st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 6), st.booleans()), max_size=25),
)
def test_the_ledger_agrees_with_kueues_available_at_every_step(tree: dict, steps: list) -> None:
    tm = parse_teams(tree)
    q = QuotaLedger(tm)
    usage = {name: ZERO for name in tm}
    for team, gpus, add in steps:
        r = Resources.of(gpus, 1)
        problem = q.check(team, r)
        fits = r.gpu <= _available(tm, usage, team, "gpu") and r.cpu <= _available(
            tm, usage, team, "cpu"
        )
        assert (problem is None) == fits, (team, gpus, usage, problem)
        if problem is None and add:
            q.add(team, r)
            usage[team] = usage[team] + r
        elif not add and usage[team].gpu >= r.gpu and usage[team].cpu >= r.cpu:
            q.remove(team, r)
            usage[team] = usage[team] - r
        assert tree_excess(tm, usage) is None  # the ledger never lets a level break
        assert q.usage == usage
        # What the ledger keeps per cohort is what the tree's sums say.
        clone = q.clone()
        assert clone.cohort_used == q.cohort_used and clone.pool_used == q.pool_used


def _trace() -> list[TraceJob]:
    jobs = []
    for i in range(60):
        team = "abc"[i % 3]
        jobs.append(TraceJob(f"j{i}", i * 30.0, team, 1 + i % 2, 2.0, 600 + 37 * (i % 7)))
    return jobs


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_a_replay_under_a_tree_keeps_every_level_and_the_audit_checks_it(policy: str) -> None:
    tm = parse_teams(TREE)
    cl = cluster(nodes=3, gpus=8)
    trace = _trace()
    result = simulate(cl, tm, trace, POLICIES[policy])
    by_id = {j.job_id: j for j in trace}
    audit_or_raise(result.events, cl, tm, POLICIES[policy], by_id)
    assert sum(e["type"] == "finish" for e in result.events) == len(trace)


def test_the_audit_flags_a_log_where_a_cohort_takes_more_than_its_limits() -> None:
    """c (at the root) may borrow only the 4 GPUs research lends: a log in which it holds 16
    breaks the root's pool; one in which research's teams hold 18 of a 16 + 0 ceiling breaks
    research's borrowing limit."""
    tm = parse_teams(
        {
            **TREE,
            "cohorts": [
                {"name": "research", "lending_limit": {"gpus": 4}, "borrowing_limit": {"gpus": 0}},
                {"name": "nlp", "parent": "research"},
            ],
        }
    )
    cl = cluster(nodes=3, gpus=8)
    jobs = {
        "big-c": TraceJob("big-c", 0.0, "c", 2, 8.0, 100.0),
        "big-a": TraceJob("big-a", 0.0, "a", 2, 8.0, 100.0),
        "more-b": TraceJob("more-b", 0.0, "b", 1, 2.0, 100.0),
    }

    def log(*admits: tuple[str, list[tuple[str, list[int]]]]) -> list[dict[str, Any]]:
        events = []
        for job_id, _ in admits:
            j = jobs[job_id]
            events.append({"t": 0.0, "type": "submit", "job": job_id, "team": j.team})
        for job_id, placement in admits:
            events.append(
                {
                    "t": 0.0,
                    "type": "admit",
                    "job": job_id,
                    "team": jobs[job_id].team,
                    "placement": [{"node": n, "gpus": g} for n, g in placement],
                    "level": "cluster",
                    "slowdown": 1.0,
                }
            )
        return events

    full = list(range(8))
    root = audit(log(("big-c", [("n0", full), ("n1", full)])), cl, tm, POLICIES["berth"], jobs)
    assert any("the cohort lends more gpus" in v.message for v in root), root
    over = audit(
        log(("big-a", [("n0", full), ("n1", full)]), ("more-b", [("n2", [0, 1])])),
        cl,
        tm,
        POLICIES["berth"],
        jobs,
    )
    assert any("cohort research uses more gpus" in v.message for v in over), over


def test_a_job_larger_than_its_tree_lets_it_ever_hold_is_rejected() -> None:
    tm = parse_teams(TREE)
    cl = cluster(nodes=3, gpus=8)
    assert check_job(job("fits", "c", gpus=6, replicas=2), cl, tm) is None  # 12 of 12
    rejection = check_job(job("huge", "c", gpus=8, replicas=2), cl, tm)
    assert rejection is not None and rejection.field == "replicas"
    assert "may hold at most 12" in rejection.message and "cohorts" in rejection.message


@pytest.mark.parametrize(
    ("tree", "weight", "first"), [(True, 1, "c2"), (False, 1, "b2"), (True, 3, "b2")]
)
def test_fair_share_follows_the_tree_a_departments_share_first(
    tree: bool, weight: float, first: str
) -> None:
    """b and c both borrow for their next job. Alone, b's share (6 of 24 GPUs) is below c's
    (8): b goes first. In a department with a (8 more), the department's share (14) is
    compared with c's, and c goes first; unless the department weighs 3 (14 / 3 < 8)."""
    spec: dict[str, Any] = {
        "teams": [
            {"name": "a", "nominal": {"gpus": 8}},
            {"name": "b", "nominal": {"gpus": 6}},
            {"name": "c", "nominal": {"gpus": 10}},
        ]
    }
    if tree:
        spec["cohorts"] = [{"name": "dept", "weight": weight}]
        spec["teams"][0]["cohort"] = spec["teams"][1]["cohort"] = "dept"
    w = World(cluster(nodes=3, gpus=8), parse_teams(spec))
    w.submit(job("a1", "a", gpus=8), job("b1", "b", gpus=6), job("c1", "c", gpus=8))
    assert sorted(admitted(w.cycle())) == ["a1", "b1", "c1"]
    w.submit(job("b2", "b", gpus=2), job("c2", "c", gpus=4), at=1.0)
    res = w.cycle(at=1.0)
    order = [n.job_id for n in res.nominations]
    assert order[0] == first and sorted(order) == ["b2", "c2"]
    assert admitted(res) == ["b2"]  # c2 finds no room for 4 GPUs either way


def test_the_simulators_summary_and_report_have_a_row_per_cohort(tmp_path) -> None:
    """research's row sums its teams' (a through nlp, and b), nlp's is a's alone."""
    tm = parse_teams(TREE)
    cl = cluster(nodes=3, gpus=8)
    result = simulate(cl, tm, _trace(), POLICIES["berth"])
    info = ClusterInfo({n.name: n.gpus for n in cl.nodes})
    summary = summarize(result.events, info, team_infos(tm), policy="berth", wall_s=0)
    data = summary.as_dict()
    teams = {r["team"]: r for r in data["teams"]}
    cohorts = {r["cohort"]: r for r in data["cohorts"]}
    assert set(cohorts) == {"research", "nlp"}
    assert cohorts["research"]["teams"] == "a, b" and cohorts["nlp"]["teams"] == "a"
    assert cohorts["research"]["jobs"] == teams["a"]["jobs"] + teams["b"]["jobs"]
    hours = teams["a"]["gpu_hours"] + teams["b"]["gpu_hours"]
    assert cohorts["research"]["gpu_hours"] == pytest.approx(hours, abs=1e-3)
    assert cohorts["nlp"]["avg_jct_s"] == pytest.approx(teams["a"]["avg_jct_s"], abs=1e-3)
    write_report(tmp_path, summary, title="tree")
    report = (tmp_path / "report.md").read_text()
    assert "## Cohorts (the organization tree" in report and "| research | a, b |" in report
    flat = [TeamInfo(t.name, t.nominal_gpus) for t in team_infos(tm)]  # no cohorts given
    assert "cohorts" not in summarize(result.events, info, flat, policy="b", wall_s=0).as_dict()


# Two departments of two teams, 8 GPUs of nominal each, on 32 GPUs.
DEPARTMENTS = {
    "cohorts": [{"name": "vision"}, {"name": "language"}],
    "teams": [
        {"name": "p", "cohort": "vision", "nominal": {"gpus": 8}},
        {"name": "q", "cohort": "vision", "nominal": {"gpus": 8}},
        {"name": "t", "cohort": "language", "nominal": {"gpus": 8}},
        {"name": "u", "cohort": "language", "nominal": {"gpus": 8}},
    ],
}


def _departments_replay(policy: str, t_jobs: int, q_jobs: int) -> tuple[list[dict], dict]:
    tm = parse_teams(DEPARTMENTS)
    cl = cluster(nodes=4, gpus=8)
    trace = [TraceJob(f"q{i}", 0.0, "q", 1, 8.0, 50_000.0) for i in range(q_jobs)]
    trace += [TraceJob(f"t{i}", 5.0, "t", 1, 8.0, 50_000.0) for i in range(t_jobs)]
    trace.append(TraceJob("p1", 10.0, "p", 1, 8.0, 100.0))
    jobs = {j.job_id: j for j in trace}
    events = simulate(cl, tm, trace, POLICIES[policy]).events
    audit_or_raise(events, cl, tm, POLICIES[policy], jobs)
    return events, jobs


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_a_reclaim_takes_back_from_its_own_department_not_one_within_its_quota(
    policy: str,
) -> None:
    """q borrows p's idle 8 GPUs inside vision; t borrows u's inside language, which stays
    within its quota. p's job takes back from q, though t's jobs started later (cheaper to
    lose): language's GPUs are its own, as Kueue's hierarchical reclaim has it (a candidate's
    cohorts below the common one must borrow). It took t's before."""
    events, _ = _departments_replay(policy, t_jobs=2, q_jobs=2)
    [taken] = [e for e in events if e["type"] == "preempt"]
    assert (taken["team"], taken["by"]) == ("q", "p1")


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_a_reclaim_takes_back_from_another_department_that_borrows(policy: str) -> None:
    """q keeps within its nominal; t runs 24 GPUs, language borrowing p's idle 8 through the
    root: p's job takes one of t's back."""
    events, _ = _departments_replay(policy, t_jobs=3, q_jobs=1)
    [taken] = [e for e in events if e["type"] == "preempt"]
    assert (taken["team"], taken["by"]) == ("t", "p1")


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_a_lender_whose_quota_is_free_but_scattered_takes_room_from_any_borrower(
    policy: str,
) -> None:
    """p's 8 GPUs are free in quota but scattered (4 beside t's borrowed job, 4 beside q's);
    language holds its own quota (t borrows u's 4). Only t's job can make room on one node:
    Berth's "prefer" takes it once its searches among departments that borrow find nothing;
    Kueue's strict rule (kueue-tas) leaves p waiting until t's job ends."""
    tm = parse_teams(
        {
            "cohorts": [{"name": "vision"}, {"name": "language"}],
            "teams": [
                {"name": "p", "cohort": "vision", "nominal": {"gpus": 8}},
                {"name": "q", "cohort": "vision", "nominal": {"gpus": 4}},
                {"name": "t", "cohort": "language", "nominal": {"gpus": 8}},
                {"name": "u", "cohort": "language", "nominal": {"gpus": 4}},
            ],
        }
    )
    cl = cluster(nodes=3, gpus=8)  # 64 CPUs a node: t1 and q0 (40 each) never share one
    trace = [
        TraceJob("t0", 0.0, "t", 1, 8.0, 50_000.0),
        TraceJob("t1", 0.0, "t", 1, 4.0, 1_000.0, cpus_per_replica=40.0),
        TraceJob("q0", 0.0, "q", 1, 4.0, 50_000.0, cpus_per_replica=40.0),
        TraceJob("p1", 10.0, "p", 1, 8.0, 100.0),
    ]
    pol = POLICIES[policy]
    events = simulate(cl, tm, trace, pol).events
    audit_or_raise(events, cl, tm, pol, {j.job_id: j for j in trace})
    taken = [(e["job"], e["by"], e["t"]) for e in events if e["type"] == "preempt"]
    start = next(e["t"] for e in events if e["type"] == "admit" and e["job"] == "p1")
    if policy == "berth":
        assert taken == [("t1", "p1", 10.0 + pol.preemption_delay_s)]
        assert start == 10.0 + pol.preemption_delay_s
    else:
        assert taken == [] and start >= 1_000.0


def test_the_audit_flags_a_reclaim_from_a_department_within_its_quota() -> None:
    """The first replay's log with p's victim swapped for one of t's: language was within its
    quota, so under the strict rule (kueue-tas) the audit names the cohort; Berth's "prefer"
    may take such a victim (when no other plan exists), so its audit does not."""
    events, jobs = _departments_replay("berth", t_jobs=2, q_jobs=2)
    at = next(e["t"] for e in events if e["type"] == "preempt")
    cut = [e for e in events if e["t"] <= at]
    placed = {e["job"]: e["placement"] for e in cut if e["type"] == "admit"}
    swapped = []
    for e in cut:
        if e["type"] == "preempt":
            e = {**e, "job": "t0", "team": "t"}
        elif e["type"] == "admit" and e["job"] == "p1":
            e = {**e, "placement": placed["t0"]}
        swapped.append(e)
    tm, cl = parse_teams(DEPARTMENTS), cluster(nodes=4, gpus=8)
    message = "reclaimed by p1 of team p, but its cohort language was not borrowing"
    for policy in ("berth", "kueue-tas"):
        # The log is cut after the reclaim: the jobs still running count as not finished.
        assert {v.rule for v in audit(cut, cl, tm, POLICIES[policy], jobs)} == {"liveness"}
        found = audit(swapped, cl, tm, POLICIES[policy], jobs)
        flagged = [v.rule for v in found if message in v.message]
        assert flagged == (["preemption"] if policy == "kueue-tas" else []), found
