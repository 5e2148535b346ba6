"""Per-model quotas: `gpus.<MODEL>` keys in a team's nominal, borrowing_limit and
lending_limit, enforced beside the model-agnostic ones (scheduling/quota.py, decision 0022)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from builders import World, admitted, job, policy
from scenario_gen import TOPOLOGY_AWARE, _simulate
from test_shortcuts import _load
from typer.testing import CliRunner

from berth.cli import app
from scheduling.admission import check_job
from scheduling.config import ConfigError, parse_cluster, parse_teams
from scheduling.decisions import Reason
from scheduling.simulator.audit import audit, audit_or_raise
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import TraceJob
from scheduling.simulator.workloads import build

# Two nodes of A100s and one of H100s (faster: Berth's placer tries it first), 4 GPUs each.
CLUSTER = parse_cluster(
    {
        "nodes": [
            {"name": "a0", "gpus": 4, "gpu_model": "A100"},
            {"name": "a1", "gpus": 4, "gpu_model": "A100"},
            {"name": "h0", "gpus": 4, "gpu_model": "H100"},
        ],
        "gpu_speed": {"H100": 2.0},
    }
)


def _teams(*specs: dict[str, Any]) -> dict:
    return parse_teams(list(specs))


def _models(w: World, job_id: str) -> set[str]:
    return {w.cluster.nodes[r.node].gpu_model for r in w.state.running[job_id].placement.replicas}


def test_keys_are_read_per_model_and_mistakes_name_the_key_and_the_fix() -> None:
    t = _teams(
        {
            "name": "a",
            "nominal": {"gpus": 12, "gpus.H100": 2},
            "borrowing_limit": {"gpus.H100": 1},
            "lending_limit": {"gpus.H100": 0, "gpus.A100": 0},
        }
    )["a"]
    by_model = {q.model: q for q in t.models}
    assert set(by_model) == {"A100", "H100"}
    h = by_model["H100"]
    assert (h.nominal, h.ceiling, h.lends, h.guaranteed) == (2000, 3000, 0, 2000)
    a = by_model["A100"]  # named only in a limit: no nominal, may only borrow A100s
    assert (a.nominal, a.lends) == (0, 0)
    bad = [
        ({"gpus": 4, "gpu.H100": 1}, "unknown key 'gpu.H100'"),
        ({"gpus": 4, "gpus.": 1}, "gpus.<MODEL>"),
        ({"gpus": 4, "gpus.H100": -1}, "not a number of GPUs >= 0"),
        ({"gpus": 4, "gpus.H100": "many"}, "not a number of GPUs >= 0"),
        ({"gpus": 4, "gpus.H100": float("inf")}, "not a number of GPUs >= 0"),
    ]
    for nominal, words in bad:
        with pytest.raises(ConfigError, match=r"teams\.0\.nominal") as e:
            _teams({"name": "a", "nominal": nominal})
        assert words in str(e.value)
    with pytest.raises(ConfigError, match=r"lending_limit.gpus.H100 exceeds its nominal"):
        _teams({"name": "a", "nominal": {"gpus.H100": 1}, "lending_limit": {"gpus.H100": 2}})


def test_a_model_the_cluster_lacks_is_an_error_naming_the_key_and_the_models() -> None:
    with pytest.raises(ConfigError) as e:
        World(CLUSTER, _teams({"name": "a", "nominal": {"gpus": 8, "gpus.H200": 4}}))
    assert "gpus.H200" in str(e.value) and "A100, H100" in str(e.value)


def test_a_team_stays_within_its_models_ceiling_and_goes_to_another_model() -> None:
    w = World(
        CLUSTER,
        _teams(
            {
                "name": "a",
                "nominal": {"gpus": 12, "gpus.H100": 2},
                "borrowing_limit": {"gpus.H100": 0},
            }
        ),
    )
    w.submit(job("h1", gpus=1, gpu_models=("H100",)), job("h2", gpus=1, gpu_models=("H100",)))
    w.submit(job("h3", gpus=1, gpu_models=("H100",)), job("any", gpus=2), at=0)
    result = w.cycle(0)
    assert set(admitted(result)) == {"h1", "h2", "any"}
    assert _models(w, "any") == {"A100"}  # the faster H100s have room, its quota has not
    reason = result.pending["h3"]
    assert reason.code == Reason.QUOTA and reason.resource == "gpus.H100"
    assert "team a would exceed nominal + borrowing_limit for gpus.H100" in reason.message
    w.finish("h1")
    assert admitted(w.cycle(10)) == ["h3"]


def test_what_a_team_does_not_lend_of_a_model_no_other_team_can_take() -> None:
    """Once a team declares a model, every team's use of it counts: the others borrow it from
    the model's pool (what the declaring teams lend, and what no nominal claims)."""
    teams = _teams(
        {"name": "a", "nominal": {"gpus": 6, "gpus.H100": 4}, "lending_limit": {"gpus.H100": 1}},
        {"name": "b", "nominal": {"gpus": 6, "gpus.H100": 0}},
        {"name": "c", "nominal": {"gpus": 0}},
    )
    w = World(CLUSTER, teams)
    # The 4 H100s are all a's nominal; it lends 1: the pool holds 1 H100.
    w.submit(job("b1", "b", gpus=2, gpu_models=("H100",)), job("c1", "c", gpus=1))
    result = w.cycle(0)
    assert admitted(result) == ["c1"] and _models(w, "c1") == {"H100"}  # c has no key: any model
    assert result.pending["b1"].resource == "gpus.H100"
    assert "cohort has no idle gpus.H100 left to lend to team b" in result.pending["b1"].message
    w.submit(job("c2", "c", gpus=1, gpu_models=("H100",)), at=1)
    r = w.cycle(1)
    assert r.pending["c2"].resource == "gpus.H100"  # the one H100 lent is taken
    # a's 3 H100s it does not lend are its own, whoever else wants H100s.
    w.submit(*(job(f"a{i}", "a", gpus=1, gpu_models=("H100",)) for i in range(3)), at=2)
    assert sorted(admitted(w.cycle(2))) == ["a0", "a1", "a2"]


def test_jobs_that_their_models_quotas_can_never_hold_are_rejected_at_submission() -> None:
    # a keeps its 2 H100s and all 8 A100s (lends none); b keeps 1 H100. The pools: H100s no
    # nominal claims (1), A100s none.
    teams = _teams(
        {
            "name": "a",
            "nominal": {"gpus": 12, "gpus.H100": 2, "gpus.A100": 8},
            "lending_limit": {"gpus.H100": 0, "gpus.A100": 0},
        },
        {"name": "b", "nominal": {"gpus": 4, "gpus.H100": 1}, "lending_limit": {"gpus.H100": 0}},
    )
    r = check_job(job("b3", "b", gpus=3), CLUSTER, teams)  # H100s: 1 + 1; A100s: none
    assert r is not None and r.field == "gpu_model"
    assert "at most 0 of gpus.A100, 2 of gpus.H100" in r.message  # the cluster's order
    assert check_job(job("b2", "b", gpus=2), CLUSTER, teams) is None  # 1 H100 + the free one
    h4 = check_job(job("a-h4", "a", gpus=4, gpu_models=("H100",)), CLUSTER, teams)
    assert h4 is not None and "3 of gpus.H100" in h4.message
    assert check_job(job("a-any4", "a", gpus=4), CLUSTER, teams) is None  # on A100s
    # A non-preemptible job may not borrow: b has no A100 of its own.
    stuck = check_job(
        job("b-np", "b", gpus=1, gpu_models=("A100",), preemptible=False), CLUSTER, teams
    )
    assert stuck is not None and stuck.field == "gpu_model"


TEAMS = [
    {"name": "a", "nominal": {"gpus": 6, "gpus.H100": 2}, "borrowing_limit": {"gpus.H100": 1}},
    {"name": "b", "nominal": {"gpus": 6, "gpus.H100": 2}, "lending_limit": {"gpus.H100": 1}},
]


def _trace() -> list[TraceJob]:
    return [
        TraceJob(
            f"j{i}",
            float(i),
            "ab"[i % 2],
            1,
            float(1 + i % 3),
            100.0 + 37 * i,
            gpu_model="H100|A100" if i % 3 else "H100",
        )
        for i in range(24)
    ]


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_a_replay_keeps_every_model_key_and_the_audit_checks_it(policy: str) -> None:
    teams = parse_teams(TEAMS)
    trace = _trace()
    jobs = {j.job_id: j for j in trace}
    result = simulate(CLUSTER, teams, trace, POLICIES[policy])
    audit_or_raise(result.events, CLUSTER, teams, POLICIES[policy], jobs)
    finished = {e["job"] for e in result.events if e["type"] == "finish"}
    assert finished == set(jobs)
    # Four H100-only jobs of team a at once: its H100 ceiling is 3. Replayed with teams
    # without model keys, all four take the H100 node, and the audit says so.
    rush = [TraceJob(f"r{i}", 0.0, "a", 1, 1.0, 500.0, gpu_model="H100") for i in range(4)]
    kept = simulate(CLUSTER, teams, rush, POLICIES[policy])
    audit_or_raise(kept.events, CLUSTER, teams, POLICIES[policy], {j.job_id: j for j in rush})
    first = {e["job"] for e in kept.events if e["type"] == "admit" and e["t"] == 0}
    assert len(first) == 3
    loose = parse_teams([{"name": t["name"], "nominal": {"gpus": 6}} for t in TEAMS])
    free = simulate(CLUSTER, loose, rush, POLICIES[policy])
    found = audit(free.events, CLUSTER, teams, POLICIES[policy], {j.job_id: j for j in rush})
    assert {v.rule for v in found} == {"quota"} and all("gpus.H100" in v.message for v in found)
    messages = " | ".join(v.message for v in found)
    assert "uses 4 gpus.H100, above its nominal + borrowing_limit of 3" in messages
    assert "lends more gpus.H100 than its teams lend" in messages  # a borrows 2, b lends 1


def test_berth_check_explains_the_model_keys_and_refuses_an_unknown_model(tmp_path) -> None:
    (tmp_path / "cluster.yaml").write_text(
        "name: mixed\nnodes:\n  - {name: a0, gpus: 8, gpu_model: A100}\n"
        "  - {name: h0, gpus: 8, gpu_model: H100}\ngpu_speed: {H100: 2.5}\n"
    )
    teams = tmp_path / "teams.yaml"
    teams.write_text(
        "teams:\n  - name: vision\n    nominal: {gpus: 8, gpus.H100: 4}\n"
        "    borrowing_limit: {gpus.H100: 2}\n    lending_limit: {gpus.H100: 1}\n"
        "  - name: nlp\n    nominal: {gpus: 8, gpus.H100: 2}\n"
    )
    args = ["check", "--cluster", str(tmp_path / "cluster.yaml"), "--teams", str(teams)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "GPU models: A100 8 GPUs (speed 1), H100 8 GPUs (speed 2.5)" in res.output
    # vision: 3 guaranteed + what vision (1) and nlp (2) lend = 6, its ceiling too.
    assert "gpus.H100: nominal 4, borrowing_limit 2, lends 1: guaranteed 3, may hold up to 6" in (
        res.output
    )
    assert "A100: no per-model limit, within its gpus" in res.output
    teams.write_text("teams:\n  - name: vision\n    nominal: {gpus: 8, gpus.H200: 4}\n")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "gpus.H200" in res.output and "A100, H100" in res.output


# a's nominal holds all 4 H100s, lent out by default; b declares no H100 key: it borrows them.
LENDER = [
    {"name": "a", "nominal": {"gpus": 6, "gpus.H100": 4}},
    {"name": "b", "nominal": {"gpus": 6}},
]


def test_a_team_reclaims_the_model_it_lent_from_a_team_within_its_total_nominal() -> None:
    """b runs 4 one-GPU jobs on the H100s, within its total nominal (6) but borrowing every
    H100 from a's nominal. a's 2-GPU H100 job may take 2 of them back after its preemption
    delay, though b borrows nothing in total (reclaim of the totals would not touch b)."""
    w = World(CLUSTER, _teams(*LENDER))
    w.submit(*(job(f"b{i}", "b", gpus=1, gpu_models=("H100",)) for i in range(4)))
    assert len(admitted(w.cycle(0))) == 4
    w.submit(job("a-h", "a", gpus=2, gpu_models=("H100",)), at=10)
    early = w.cycle(10)
    assert not early.admitted and not early.preempted
    assert early.pending["a-h"].resource == "gpus.H100"
    assert early.next_wakeup == 10 + w.policy.preemption_delay_s
    result = w.cycle(early.next_wakeup)
    assert admitted(result) == ["a-h"] and _models(w, "a-h") == {"H100"}
    assert len(result.preempted) == 2 and {p.by for p in result.preempted} == {"a-h"}
    # Not past a's nominal of H100s: a third job of a's waits for b's next finish.
    assert w.state.quota.model_usage[("a", "H100")] == 2000


def test_a_team_reclaims_the_model_it_lent_when_the_models_it_may_borrow_have_no_room() -> None:
    """The H100s a lends are all borrowed by b; the A100s (no team's key: any team may use
    them) are held by c within its nominal, with one GPU free per node. a's 2-GPU job that
    takes any model fits its quotas on the A100s, where there is no room, and not on the
    H100s, where there would be once b's jobs go: it takes back 2 H100s after its delay, as a
    job the H100 key alone holds back does (found by fresh examples on the lent H200)."""
    teams = _teams(*LENDER, {"name": "c", "nominal": {"gpus": 6}})
    w = World(CLUSTER, teams)
    w.submit(*(job(f"b{i}", "b", gpus=1, gpu_models=("H100",)) for i in range(4)))
    w.submit(*(job(f"c{i}", "c", gpus=3, gpu_models=("A100",)) for i in range(2)))
    assert len(admitted(w.cycle(0))) == 6
    w.submit(job("a-any", "a", gpus=2), at=10)
    early = w.cycle(10)
    assert not early.admitted and not early.preempted
    assert early.pending["a-any"].code == Reason.NO_PLACEMENT
    assert early.next_wakeup == 10 + w.policy.preemption_delay_s
    result = w.cycle(early.next_wakeup)
    assert admitted(result) == ["a-any"] and _models(w, "a-any") == {"H100"}
    assert len(result.preempted) == 2 and {p.by for p in result.preempted} == {"a-any"}


def test_a_model_reclaim_goes_on_to_the_next_model_the_job_accepts() -> None:
    """b borrows every H100 and every A100 (no keys of its own). a's 4-GPU job needs one GPU
    group of 4: the H100 node has groups of 2, so no reclaim of H100s can place it, and it
    takes back the A100s it accepts next instead of waiting on the H100s for ever."""
    cluster = parse_cluster(
        {
            "nodes": [
                {"name": "h0", "gpus": 4, "gpu_groups": 2, "gpu_model": "H100"},
                {"name": "a0", "gpus": 4, "gpu_model": "A100"},
            ]
        }
    )
    teams = _teams(
        {"name": "a", "nominal": {"gpus": 8, "gpus.H100": 4, "gpus.A100": 4}},
        {"name": "b", "nominal": {"gpus": 8}},
    )
    w = World(cluster, teams, policy(preemption_delay_s=0.0))
    w.submit(*(job(f"bh{i}", "b", gpus=1, gpu_models=("H100",)) for i in range(4)))
    w.submit(*(job(f"ba{i}", "b", gpus=1, gpu_models=("A100",)) for i in range(4)))
    assert len(admitted(w.cycle(0))) == 8
    w.submit(job("a4", "a", gpus=4, topology="gpu_group", gpu_models=("H100", "A100")), at=10)
    result = w.cycle(10)
    assert admitted(result) == ["a4"] and _models(w, "a4") == {"A100"}
    assert {p.job_id for p in result.preempted} == {f"ba{i}" for i in range(4)}


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_a_key_for_a_model_never_costs_a_team_its_total_guarantee(policy: str) -> None:
    """b borrows in total (8 GPUs of its nominal 4) and every H100 (no key of its own for
    them). a's 4-GPU H100 job is within a's nominal and its H100 key, but the H100 pool is
    full: the totals' reclaim must give back b's H100s to a's key too, or a waits as long as
    b runs (it did: declaring the key lost a its guarantee)."""
    teams = _teams(
        {"name": "a", "nominal": {"gpus": 4, "gpus.H100": 4}}, {"name": "b", "nominal": {"gpus": 4}}
    )
    trace = [
        TraceJob("b1", 0.0, "b", 1, 4.0, 50_000.0, gpu_model="H100"),
        TraceJob("b2", 0.0, "b", 1, 4.0, 50_000.0, gpu_model="A100"),
        TraceJob("a1", 10.0, "a", 1, 4.0, 100.0, gpu_model="H100"),
    ]
    pol = POLICIES[policy]
    events = simulate(CLUSTER, teams, trace, pol).events
    audit_or_raise(events, CLUSTER, teams, pol, {j.job_id: j for j in trace})
    [taken] = [e for e in events if e["type"] == "preempt"]
    assert (taken["job"], taken["by"]) == ("b1", "a1")
    assert taken["t"] == 10.0 + pol.preemption_delay_s


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_a_replayed_model_reclaim_passes_the_audit_and_one_without_a_claim_does_not(
    policy: str,
) -> None:
    teams = parse_teams(LENDER)
    trace = [TraceJob(f"b{i}", 0.0, "b", 1, 1.0, 5000.0, gpu_model="H100") for i in range(4)]
    trace.append(TraceJob("a-h", 10.0, "a", 1, 2.0, 100.0, gpu_model="H100"))
    jobs = {j.job_id: j for j in trace}
    events = simulate(CLUSTER, teams, trace, POLICIES[policy]).events
    audit_or_raise(events, CLUSTER, teams, POLICIES[policy], jobs)
    preempted = [e for e in events if e["type"] == "preempt"]
    assert len(preempted) == 2 and {e["by"] for e in preempted} == {"a-h"}
    # The same log, read with a holding no H100 nominal: those preemptions took b's GPUs
    # below b's nominal for no claim of a's.
    unclaimed = parse_teams([LENDER[0] | {"nominal": {"gpus": 6}}, LENDER[1]])
    found = audit(events, CLUSTER, unclaimed, POLICIES[policy], jobs)
    assert found and {v.rule for v in found} == {"preemption"}


def test_a_model_reclaim_that_waits_for_victims_to_come_of_age_wakes_then() -> None:
    w = World(CLUSTER, _teams(*LENDER), policy(min_runtime_s=300.0, preemption_delay_s=0.0))
    w.submit(*(job(f"b{i}", "b", gpus=1, gpu_models=("H100",)) for i in range(4)))
    w.cycle(0)
    w.submit(job("a-h", "a", gpus=1, gpu_models=("H100",)), at=10)
    young = w.cycle(10)
    assert not young.preempted and young.next_wakeup == 300.0  # b's jobs are too young
    result = w.cycle(300.0)
    assert admitted(result) == ["a-h"] and len(result.preempted) == 1


@pytest.mark.parametrize("total", [6, 1])
def test_a_team_reclaims_a_model_only_within_its_total_nominal_too(total: int) -> None:
    """Within its H100 nominal but borrowing in total (nominal 1 GPU), a's job does not
    reclaim: b, within its total, would take the GPUs back by the totals' reclaim, and so on
    (the quality benchmark's models-quota family livelocked under kueue-tas without it)."""
    teams = _teams({"name": "a", "nominal": {"gpus": total, "gpus.H100": 4}}, LENDER[1])
    w = World(CLUSTER, teams, policy(preemption_delay_s=0.0))
    w.submit(*(job(f"b{i}", "b", gpus=1, gpu_models=("H100",)) for i in range(4)))
    w.cycle(0)
    w.submit(job("a-h", "a", gpus=2, gpu_models=("H100",)), at=10)
    result = w.cycle(10)
    assert (admitted(result) == ["a-h"]) is (total == 6)
    assert len(result.preempted) == (2 if total == 6 else 0)


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_the_models_quota_family_replays_within_every_key(policy: str) -> None:
    """The quality benchmark's `models-quota` workload (three models, keys for two teams),
    a short run of it, audited: every key kept, every reclaim of a model a reclaim."""
    work = build("models-quota", 1, jobs=300)
    result = simulate(work.cluster, work.teams, work.jobs, POLICIES[policy])
    jobs = {j.job_id: j for j in work.jobs}
    audit_or_raise(result.events, work.cluster, work.teams, POLICIES[policy], jobs)
    models = {q.model for t in work.teams.values() for q in t.models}
    assert models == {"H100", "A100"}


LIVELOCKS = sorted((Path(__file__).parent / "data" / "livelocks_fixed").glob("*.json"))


@pytest.mark.parametrize("path", LIVELOCKS, ids=[p.stem for p in LIVELOCKS])
@pytest.mark.parametrize("name", TOPOLOGY_AWARE)
def test_scenarios_that_livelocked_end_and_pass_the_audit(path: Path, name: str) -> None:
    """Each file's replay livelocked under its `policy` before the fix its `cause` names (the
    simulator's preemption guard raised `Livelock`); every job now settles, audited."""
    s = _load(path)
    result = _simulate(s, name)
    audit_or_raise(result.events, s.cluster, s.teams, s.policy(name), s.jobs)
    settled = {e["job"] for e in result.events if e["type"] in ("finish", "reject")}
    assert settled == set(s.jobs)
