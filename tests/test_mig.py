"""MIG (scheduling/mig.py): GPUs an admin partitioned into instances, jobs that ask for one
instance of a profile per replica, quotas that count an instance by its compute share, and
the audit that checks no instance is given twice and no partitioned GPU is used whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import World, admitted, job
from scenario_gen import TOPOLOGY_AWARE, _simulate
from test_shortcuts import _load
from typer.testing import CliRunner

from berth.cli import app
from scheduling.admission import check_job
from scheduling.capacity import Capacity
from scheduling.config import ConfigError, parse_cluster, parse_teams
from scheduling.mig import place_mig, share_of
from scheduling.placement import place_gang
from scheduling.simulator.audit import audit, audit_or_raise
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import TraceFormatError, TraceJob, load_trace

# m0: GPU 0 as 3g + 2g + 1g + 1g, GPU 1 as seven 1g, GPUs 2-3 whole; m1: four whole GPUs.
CLUSTER = parse_cluster(
    {
        "topology_levels": ["rack"],
        "nodes": [
            {
                "name": "m0",
                "gpus": 4,
                "gpu_model": "A100",
                "labels": {"rack": "r0"},
                "mig": {0: ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], 1: ["1g.10gb"] * 7},
            },
            {"name": "m1", "gpus": 4, "gpu_model": "A100", "labels": {"rack": "r0"}},
        ],
    }
)
M1 = "1g.10gb"
TEAMS = parse_teams([{"name": "a", "nominal": {"gpus": 4}}, {"name": "b", "nominal": {"gpus": 4}}])


def mig_job(job_id: str, team: str, replicas: int, profile: str, **kw) -> object:
    return job(job_id, team, gpus=share_of(profile) / 1000, replicas=replicas, mig=profile, **kw)


def test_partitions_are_read_per_gpu_and_mistakes_name_the_field_and_the_fix() -> None:
    m0 = CLUSTER.by_name["m0"]
    assert m0.mig[:4] == ((0, "3g.40gb"), (0, "2g.20gb"), (0, "1g.10gb"), (0, "1g.10gb"))
    assert len(m0.mig) == 11 and m0.all_gpus == 0b1100  # GPUs 0 and 1 are no whole GPUs
    assert (share_of("1g.10gb"), share_of("3g.40gb"), share_of("7g.80gb")) == (143, 429, 1000)
    bad = [
        ({0: ["1g.10GB"]}, "is not a MIG profile; a MIG profile is named <slices>g.<memory>gb"),
        ({4: ["1g.10gb"]}, "mig: GPU 4 is not one of the node's GPUs 0..3"),
        ({0: ["4g.40gb", "4g.40gb"]}, "take 8 compute slices; a GPU has 7"),
        ({0: []}, "mig.0: no profiles"),
    ]
    for mig, words in bad:
        with pytest.raises(ConfigError, match="nodes\\[0\\]") as e:
            parse_cluster({"nodes": [{"name": "x", "gpus": 4, "mig": mig}]})
        assert words in str(e.value)


def test_whole_and_fractional_replicas_never_land_on_a_partitioned_gpu() -> None:
    only = parse_cluster({"nodes": [{"name": "m", "gpus": 2, "mig": {0: ["7g.80gb"]}}]})
    cap = Capacity(only)
    assert place_gang(cap, job("two", "a", gpus=2)) is None  # GPU 0 is partitioned
    assert place_gang(cap, job("one", "a", gpus=1)).replicas[0].gpus == (1,)
    assert place_gang(cap, job("half", "a", gpus=0.5)).replicas[0].gpus == (1,)
    seven = place_gang(cap, mig_job("i", "a", 1, "7g.80gb"))
    assert seven is not None and seven.replicas[0].gpus == (0,)


def test_instances_of_the_profile_best_fit_one_per_replica() -> None:
    cap = Capacity(CLUSTER)
    # Two 1g instances: GPU 0 has 2 of them, GPU 1 seven: best fit takes GPU 0's.
    p = place_mig(cap, mig_job("j", "a", 2, "1g.10gb"))
    assert [(r.gpus, r.instance, r.share) for r in p.replicas] == [((0,), 2, 143), ((0,), 3, 143)]
    assert p.level == "node"  # MIG instances share no NVLink: a gang of them is node-level
    one = place_mig(cap, mig_job("k", "a", 1, "3g.40gb"))
    assert [(r.gpus, r.instance) for r in one.replicas] == [((0,), 0)] and one.level == "gpu_group"
    assert place_mig(cap, mig_job("big", "a", 2, "3g.40gb")) is None  # there is only one
    assert place_mig(cap, mig_job("none", "a", 1, "4g.40gb")) is None
    for r in p.replicas:
        cap.take_replica(r, 0, 0)
    with pytest.raises(ValueError, match="MIG instance 2 on node 0 is not free"):
        cap.take_replica(p.replicas[0], 0, 0)
    nine = place_mig(cap, mig_job("nine", "a", 7, "1g.10gb"))
    assert {r.instance for r in nine.replicas} == set(range(4, 11))  # GPU 1's seven


def test_a_mig_job_is_refused_with_the_field_and_what_the_cluster_has() -> None:
    r = check_job(mig_job("x", "a", 1, "2g.10gb"), CLUSTER, TEAMS)
    assert r.field == "mig_profile" and "it has: 1g.10gb, 2g.20gb, 3g.40gb" in r.message
    r = check_job(mig_job("g", "a", 2, "1g.10gb", topology="gpu_group"), CLUSTER, TEAMS)
    assert r.field == "topology" and "share no NVLink" in r.message
    r = check_job(mig_job("many", "a", 2, "2g.20gb"), CLUSTER, TEAMS)
    assert r.reason == "infeasible" and "2 x 2g.20gb MIG instance" in r.message
    assert check_job(mig_job("ok", "a", 9, "1g.10gb"), CLUSTER, TEAMS) is None
    r = check_job(mig_job("h", "a", 1, "1g.10gb", gpu_models=("H100",)), CLUSTER, TEAMS)
    assert r.field == "gpu_model"  # the model check comes first: no H100 at all


def test_quotas_count_an_instance_by_its_compute_share() -> None:
    w = World(CLUSTER, TEAMS)
    w.submit(mig_job("seven", "a", 7, "1g.10gb"), mig_job("three", "b", 1, "3g.40gb"))
    assert sorted(admitted(w.cycle(0))) == ["seven", "three"]
    assert w.state.quota.usage["a"].gpu == 7 * 143 and w.state.quota.usage["b"].gpu == 429


@pytest.mark.parametrize("policy", ["berth", "kueue-tas", "quota-spread", "fifo"])
def test_a_replay_with_mig_jobs_passes_the_audit(policy: str) -> None:
    trace = [
        TraceJob(f"m{i}", float(i), "ab"[i % 2], 1 + i % 3, 0.143, 200.0 + 50 * i, mig_profile=M1)
        for i in range(12)
    ]
    trace += [
        TraceJob("big", 1.0, "a", 1, 0.429, 300.0, mig_profile="3g.40gb"),
        TraceJob("whole", 2.0, "b", 2, 1.0, 300.0),
        TraceJob("frac", 3.0, "a", 2, 0.5, 300.0),
    ]
    jobs = {j.job_id: j for j in trace}
    result = simulate(CLUSTER, TEAMS, trace, POLICIES[policy])
    audit_or_raise(result.events, CLUSTER, TEAMS, POLICIES[policy], jobs)
    assert {e["job"] for e in result.events if e["type"] == "finish"} == set(jobs)
    placed = [p for e in result.events if e["type"] == "admit" for p in e["placement"]]
    mig = [p for p in placed if "instance" in p]
    assert mig and all(p["node"] == "m0" and p["gpus"][0] in (0, 1) for p in mig)
    assert all(p["gpus"][0] >= 2 for p in placed if "instance" not in p and p["node"] == "m0")


def test_the_audit_flags_an_instance_given_twice_and_a_partitioned_gpu_used_whole() -> None:
    a = TraceJob("a1", 0.0, "a", 1, 0.143, 100.0, mig_profile="1g.10gb")
    b = TraceJob("b1", 0.0, "b", 1, 0.143, 100.0, mig_profile="1g.10gb")
    w = TraceJob("w1", 0.0, "b", 1, 1.0, 100.0)
    inst = {"node": "m0", "gpus": [0], "share": 0.143, "instance": 2, "mig": "1g.10gb"}

    def log(*admits: tuple[TraceJob, dict]) -> list[dict]:
        events = [{"t": 0.0, "type": "submit", "job": j.job_id, "team": j.team} for j, _ in admits]
        for j, p in admits:
            events.append({"t": 0.0, "type": "admit", "job": j.job_id, "team": j.team,
                           "placement": [p], "level": "gpu_group", "slowdown": 1.0})  # fmt: skip
        for j, _ in admits:
            events.append({"t": 100.0, "type": "finish", "job": j.job_id, "team": j.team})
        return events

    jobs = {j.job_id: j for j in (a, b, w)}
    pol = POLICIES["berth"]
    assert not audit(log((a, inst)), CLUSTER, TEAMS, pol, jobs)
    twice = audit(log((a, inst), (b, inst)), CLUSTER, TEAMS, pol, jobs)
    assert [v.rule for v in twice] == ["over_allocation"] and "MIG instance 2" in twice[0].message
    whole = audit(log((w, {"node": "m0", "gpus": [1]})), CLUSTER, TEAMS, pol, jobs)
    assert [v.rule for v in whole] == ["gang"] and "MIG-partitioned" in whole[0].message
    wrong = audit(log((a, {**inst, "instance": 0})), CLUSTER, TEAMS, pol, jobs)  # a 3g.40gb
    assert [v.rule for v in wrong] == ["gang"] and "is not a 1g.10gb" in wrong[0].message


def test_a_team_within_its_nominal_takes_back_mig_instances_borrowed_from_it() -> None:
    """b fills every 1g instance (9 x 1/7 GPU: above its nominal of 1 GPU); a's 1g job, within
    a's nominal, takes one back after its preemption delay."""
    teams = parse_teams(
        [{"name": "a", "nominal": {"gpus": 7}}, {"name": "b", "nominal": {"gpus": 1}}]
    )
    w = World(CLUSTER, teams)
    w.submit(*(mig_job(f"b{i}", "b", 1, "1g.10gb") for i in range(9)))
    assert len(admitted(w.cycle(0))) == 9
    w.submit(mig_job("a1", "a", 1, "1g.10gb"), at=10)
    assert not w.cycle(10).admitted
    result = w.cycle(10 + w.policy.preemption_delay_s)
    assert admitted(result) == ["a1"] and len(result.preempted) == 1


def test_a_trace_row_asks_for_a_profile_and_its_share_is_filled_in(tmp_path: Path) -> None:
    path = tmp_path / "jobs.csv"
    path.write_text(
        "job_id,submit_time,team,replicas,gpus_per_replica,duration,mig_profile\n"
        "a,0,a,2,,100,1g.10gb\nb,0,a,1,0.429,100,3g.40gb\nc,0,a,1,1,100,\n"
    )
    jobs = {j.job_id: j for j in load_trace(path)}
    assert (jobs["a"].gpus_per_replica, jobs["a"].mig_profile) == (0.143, "1g.10gb")
    assert jobs["b"].gpus_per_replica == 0.429 and jobs["c"].mig_profile is None
    path.write_text(
        "job_id,submit_time,team,replicas,gpus_per_replica,duration,mig_profile\n"
        "a,0,a,1,0.5,100,1g.10gb\nb,0,a,1,,100,\nc,0,a,1,1,100,2g\n"
    )
    with pytest.raises(TraceFormatError) as e:
        load_trace(path)
    text = str(e.value)
    assert "line 2, column gpus_per_replica: a 1g.10gb instance counts 0.143 GPUs" in text
    assert "line 3, column gpus_per_replica: is required but the cell is empty" in text
    assert "line 4, column mig_profile" in text and "is not a MIG profile" in text


ENGINE_FIXED = sorted((Path(__file__).parent / "data" / "engine_fixed").glob("*.json"))


@pytest.mark.parametrize("path", ENGINE_FIXED, ids=[p.stem for p in ENGINE_FIXED])
@pytest.mark.parametrize("name", TOPOLOGY_AWARE)
def test_scenarios_the_engine_stalled_on_end_and_pass_the_audit(path: Path, name: str) -> None:
    """Each file's replay left jobs pending for ever under its `policy` before the fix its
    `cause` names (the audit's liveness rule caught it)."""
    s = _load(path)
    result = _simulate(s, name)
    audit_or_raise(result.events, s.cluster, s.teams, s.policy(name), s.jobs)


def test_berth_check_says_what_the_partitions_hold(tmp_path: Path) -> None:
    (tmp_path / "cluster.yaml").write_text(
        "nodes:\n  - {name: m0, gpus: 4, mig: {0: [3g.40gb, 1g.10gb, 1g.10gb], 1: [7g.80gb]}}\n"
    )
    (tmp_path / "teams.yaml").write_text("teams: [{name: a, nominal: {gpus: 4}}]\n")
    args = ["check", "--cluster", str(tmp_path / "cluster.yaml"), "--teams"]
    res = CliRunner().invoke(app, [*args, str(tmp_path / "teams.yaml")])
    assert res.exit_code == 0, res.output
    assert "MIG: 2 partitioned GPU(s)" in res.output
    assert "instances 2 x 1g.10gb, 1 x 3g.40gb, 1 x 7g.80gb" in res.output
    (tmp_path / "cluster.yaml").write_text("nodes:\n  - {name: m0, gpus: 4, mig: {0: [8g.80gb]}}\n")
    res = CliRunner().invoke(app, [*args, str(tmp_path / "teams.yaml")])
    assert res.exit_code == 2 and "nodes[0].mig.0: '8g.80gb' is not a MIG profile" in res.output


def test_a_held_mig_gang_admitted_later_holds_exactly_its_new_instances() -> None:
    """Under a policy that holds partial gangs, a's first instance is held, then the gang is
    admitted on two; once it ends, b may take the first instance again, and c may not take
    a's second while a runs (the audit once kept the held instance as a's for good, and
    lost track of the admitted ones)."""
    a = TraceJob("a", 0.0, "a", 2, 0.143, 100.0, mig_profile="1g.10gb")
    b = TraceJob("b", 0.0, "b", 1, 0.143, 100.0, mig_profile="1g.10gb")
    c = TraceJob("c", 0.0, "b", 1, 0.143, 100.0, mig_profile="1g.10gb")

    def inst(k: int) -> dict:
        return {"node": "m0", "gpus": [0], "share": 0.143, "instance": k, "mig": "1g.10gb"}

    def ev(t: float, kind: str, j: TraceJob, **kw: object) -> dict:
        return {"t": t, "type": kind, "job": j.job_id, "team": j.team, **kw}

    log = [ev(0.0, "submit", j) for j in (a, b)]
    log += [
        ev(0.0, "hold", a, placement=[inst(2)]),
        ev(10.0, "admit", a, placement=[inst(2), inst(3)], level="node", slowdown=1.1),
        ev(120.0, "finish", a),
        ev(130.0, "admit", b, placement=[inst(2)], level="gpu_group", slowdown=1.0),
        ev(230.0, "finish", b),
    ]
    pol, jobs = POLICIES["quota-spread"], {j.job_id: j for j in (a, b, c)}
    assert not audit(log, CLUSTER, TEAMS, pol, {"a": a, "b": b})
    clash = [ev(20.0, "submit", c), ev(20.0, "admit", c, placement=[inst(3)], level="gpu_group",
             slowdown=1.0), ev(120.0, "finish", c)]  # fmt: skip
    found = audit(sorted(log + clash, key=lambda e: e["t"]), CLUSTER, TEAMS, pol, jobs)
    assert [v.rule for v in found] == ["over_allocation"] and "instance 3 held by a" in str(found)
