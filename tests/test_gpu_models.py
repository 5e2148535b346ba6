"""GPU models: a job runs on the models it accepts, a gang on one model unless it says mixed
(scheduling/models.py); the trace's `gpu_model` column; the audit's `gpu_model` rule."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from scheduling.admission import check_job
from scheduling.config import parse_cluster, parse_teams
from scheduling.simulator.audit import audit, audit_or_raise
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.sim import simulate, to_job
from scheduling.simulator.trace import TraceFormatError, TraceJob, load_trace

# Two nodes of A100s and one of H100s, 4 GPUs each, in one rack.
SPEC: dict[str, Any] = {
    "topology_levels": ["rack"],
    "nodes": [
        {"name": "a0", "gpus": 4, "gpu_model": "A100", "labels": {"rack": "r0"}},
        {"name": "a1", "gpus": 4, "gpu_model": "A100", "labels": {"rack": "r0"}},
        {"name": "h0", "gpus": 4, "gpu_model": "H100", "labels": {"rack": "r0"}},
    ],
}
TEAMS = [{"name": "a", "nominal": {"gpus": 12}}]


def _run(trace: list[TraceJob], policy: str = "berth") -> list[dict[str, Any]]:
    cluster, teams = parse_cluster(SPEC), parse_teams(TEAMS)
    result = simulate(cluster, teams, trace, POLICIES[policy])
    audit_or_raise(result.events, cluster, teams, POLICIES[policy], {j.job_id: j for j in trace})
    return result.events


def _admits(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["job"]: e for e in events if e["type"] == "admit"}


def _nodes(admit: dict[str, Any]) -> set[str]:
    return {r["node"] for r in admit["placement"]}


@pytest.mark.parametrize("policy", ["berth", "kueue-tas", "quota-spread", "fifo"])
def test_a_gang_runs_on_one_model_unless_it_asks_for_mixed(policy: str) -> None:
    """12 GPUs: 8 A100 and 4 H100. A gang of 3 x 4 GPUs fits only across models: rejected
    unless mixed. A gang of 2 x 4 waits for the second A100 node rather than take an A100
    node and the H100 one, free since t=0."""
    trace = [
        TraceJob("one-model", 0, "a", 3, 4.0, 100),
        TraceJob("mixed", 0, "a", 3, 4.0, 100, mixed_models=True),
        TraceJob("blocker", 200, "a", 1, 2.0, 100, gpu_model="A100"),
        TraceJob("pair", 210, "a", 2, 4.0, 100),
    ]
    events = _run(trace, policy)
    rejected = {e["job"]: e for e in events if e["type"] == "reject"}
    assert set(rejected) == {"one-model"}
    assert rejected["one-model"]["field"] == "replicas"
    assert "model" in rejected["one-model"]["message"]
    admits = _admits(events)
    assert _nodes(admits["mixed"]) == {"a0", "a1", "h0"}
    assert admits["mixed"]["gpu_model"] == "A100|H100"
    assert _nodes(admits["pair"]) == {"a0", "a1"} and admits["pair"]["gpu_model"] == "A100"
    assert admits["pair"]["t"] == 300  # when the blocker ends


def test_models_are_tried_in_the_jobs_order_of_preference() -> None:
    trace = [
        TraceJob("h-first", 0, "a", 1, 4.0, 100, gpu_model="H100|A100"),
        TraceJob("h-again", 1, "a", 1, 4.0, 100, gpu_model="H100|A100"),  # H100s taken: A100
        TraceJob("h-only", 2, "a", 1, 2.0, 100, gpu_model="H100"),  # waits for h-first
    ]
    admits = _admits(_run(trace))
    assert _nodes(admits["h-first"]) == {"h0"}
    assert admits["h-again"]["gpu_model"] == "A100"
    assert _nodes(admits["h-only"]) == {"h0"} and admits["h-only"]["t"] == 100


def test_an_unknown_model_is_refused_naming_the_field_and_the_clusters_models() -> None:
    cluster, teams = parse_cluster(SPEC), parse_teams(TEAMS)
    job = to_job(TraceJob("j", 0, "a", 1, 1.0, 10, gpu_model="B200|H100"))
    rejection = check_job(job, cluster, teams)
    assert rejection is not None and rejection.field == "gpu_model"
    assert "'B200'" in rejection.message and "A100, H100" in rejection.message


def test_a_priority_preemption_takes_a_victim_of_the_model_the_job_needs() -> None:
    """Every GPU is busy with priority-0 jobs; a priority-1 job for H100s must preempt the one
    on the H100 node, which started first (the dearest to lose), though the nine on A100
    nodes, younger, cost less: more than the eight options a search confirms."""
    spec = {"nodes": [{"name": f"a{k}", "gpus": 4, "gpu_model": "A100"} for k in range(9)]}
    spec["nodes"].append({"name": "h0", "gpus": 4, "gpu_model": "H100"})
    teams = [{"name": "a", "nominal": {"gpus": 40}}]
    trace = [
        TraceJob("h-low", 0, "a", 1, 4.0, 5000, gpu_model="H100"),
        *(TraceJob(f"a-young{k}", 10 + k, "a", 1, 4.0, 5000, gpu_model="A100") for k in range(9)),
        TraceJob("h-high", 40, "a", 1, 4.0, 100, priority=1, gpu_model="H100"),
    ]
    cluster, team_map, pol = parse_cluster(spec), parse_teams(teams), POLICIES["berth"]
    pol = replace(pol, preemption_delay_s=0.0)
    result = simulate(cluster, team_map, trace, pol)
    audit_or_raise(result.events, cluster, team_map, pol, {j.job_id: j for j in trace})
    preempted = [e["job"] for e in result.events if e["type"] == "preempt"]
    assert preempted == ["h-low"]
    assert _nodes(_admits(result.events)["h-high"]) == {"h0"}


def test_a_reservation_drains_nodes_of_an_accepted_model() -> None:
    """h-big (all 4 H100s) starves from t=70: its reservation must hold h0 (the A100 nodes,
    emptier, are of no use to it), so the H100 jobs queued after it wait until it has run."""
    cluster, teams = parse_cluster(SPEC), parse_teams(TEAMS)
    pol = replace(POLICIES["berth"], starvation_s=60.0)
    trace = [
        TraceJob("h-small", 0, "a", 1, 1.0, 1000, gpu_model="H100"),
        TraceJob("h-big", 10, "a", 1, 4.0, 100, gpu_model="H100"),
        *(TraceJob(f"h-fill{k}", 100 + 50 * k, "a", 1, 1.0, 900, gpu_model="H100")
          for k in range(3)),
    ]  # fmt: skip
    result = simulate(cluster, teams, trace, pol)
    audit_or_raise(result.events, cluster, teams, pol, {j.job_id: j for j in trace})
    admits = _admits(result.events)
    assert admits["h-big"]["t"] == 1000 and _nodes(admits["h-big"]) == {"h0"}
    assert all(admits[f"h-fill{k}"]["t"] >= 1100 for k in range(3))


def test_the_trace_reads_gpu_model_and_mixed_models(tmp_path: Path) -> None:
    f = tmp_path / "jobs.csv"
    f.write_text(
        "job_id,submit_time,team,replicas,gpus_per_replica,duration,gpu_model,mixed_models\n"
        "j1,0,a,1,1,10, V100M16 | V100M32|V100M16,\n"
        "j2,0,a,2,1,10,,yes\n"
        "j3,0,a,1,1,10,,maybe\n"
    )
    with pytest.raises(TraceFormatError, match="line 4, column mixed_models"):
        load_trace(f)
    f.write_text(f.read_text().replace("maybe", "no"))
    j1, j2, j3 = load_trace(f)
    assert not j3.mixed_models
    assert j1.gpu_models == ("V100M16", "V100M32") and not j1.mixed_models
    assert j2.gpu_models == () and j2.mixed_models
    assert to_job(j1).gpu_models == ("V100M16", "V100M32")


def test_the_audit_flags_a_replica_on_a_model_not_accepted_and_a_gang_over_two() -> None:
    cluster, teams = parse_cluster(SPEC), parse_teams(TEAMS)
    jobs = {
        "h": TraceJob("h", 0, "a", 1, 1.0, 10, gpu_model="H100"),
        "g": TraceJob("g", 0, "a", 2, 1.0, 10),
    }

    def admit(job: str, *nodes: str) -> dict[str, Any]:
        placement = [{"node": n, "gpus": [0]} for n in nodes]
        level = "rack" if len(set(nodes)) > 1 else "gpu_group"
        return {"t": 0, "type": "admit", "job": job, "team": "a", "placement": placement,
                "level": level, "slowdown": 1.0}  # fmt: skip

    events = [
        {"t": 0, "type": "submit", "job": "h", "team": "a"},
        {"t": 0, "type": "submit", "job": "g", "team": "a"},
        admit("h", "a0"),
        admit("g", "a1", "h0"),
        {"t": 10, "type": "finish", "job": "h", "team": "a"},
        {"t": 10, "type": "finish", "job": "g", "team": "a"},
    ]
    found = [v for v in audit(events, cluster, teams, POLICIES["berth"], jobs)]
    rules = sorted((v.job, v.rule) for v in found if v.rule == "gpu_model")
    assert rules == [("g", "gpu_model"), ("h", "gpu_model")], found


def test_a_partial_gang_binds_on_a_model_that_can_hold_it_whole() -> None:
    """The per-replica baseline (the default scheduler behind Kueue) binds a gang's replicas
    on one model: the first that could hold the whole gang, not merely the first with room
    for one (here h0, listed first, holds one replica of three: bound there, the gang would
    time out and retry for ever; the property tests hung on it)."""
    spec = {
        "nodes": [
            {"name": "h0", "gpus": 4, "gpu_model": "H100"},
            *({"name": f"a{k}", "gpus": 4, "gpu_model": "A100"} for k in range(3)),
        ]
    }
    cluster, teams = parse_cluster(spec), parse_teams(TEAMS)
    trace = [TraceJob("gang", 0, "a", 3, 4.0, 100)]
    for policy in ("quota-spread", "fifo"):
        result = simulate(cluster, teams, trace, POLICIES[policy])
        audit_or_raise(result.events, cluster, teams, POLICIES[policy], {"gang": trace[0]})
        assert _nodes(_admits(result.events)["gang"]) == {"a0", "a1", "a2"}, policy


def test_the_summary_has_a_row_per_model() -> None:
    """GPU-hours per model are what the admitted jobs held there; jobs count on the model of
    their first admission (a mixed gang on each of its models)."""
    from scheduling.simulator.metrics import ClusterInfo, TeamInfo, summarize

    cluster, teams = parse_cluster(SPEC), parse_teams(TEAMS)
    trace = [
        TraceJob("h", 0, "a", 1, 4.0, 3600, gpu_model="H100"),
        TraceJob("a", 0, "a", 2, 2.0, 1800, gpu_model="A100"),
        TraceJob("late", 10, "a", 1, 1.0, 360, gpu_model="H100"),  # waits for h: 3,590 s
    ]
    result = simulate(cluster, teams, trace, POLICIES["berth"])
    info = ClusterInfo(
        {n.name: n.gpus for n in cluster.nodes}, {n.name: n.gpu_model for n in cluster.nodes}
    )
    data = summarize(result.events, info, [TeamInfo("a", 12)], policy="berth", wall_s=0).as_dict()
    rows = {r["model"]: r for r in data["models"]}
    assert rows["H100"]["gpus"] == 4 and rows["A100"]["gpus"] == 8
    assert rows["H100"]["gpu_hours"] == pytest.approx(4 + 0.1)
    assert rows["A100"]["gpu_hours"] == pytest.approx(2 * 2 * 0.5)
    assert rows["H100"]["jobs_admitted"] == 2 and rows["A100"]["jobs_admitted"] == 1
    assert rows["H100"]["avg_first_wait_s"] == pytest.approx(3590 / 2)
    makespan = data["makespan_s"]
    assert rows["H100"]["busy"] == pytest.approx(4.1 * 3600 / (4 * makespan), rel=1e-3)
    from scheduling.simulator.report import render_markdown

    page = render_markdown(data, title="two models")
    assert "## GPU models" in page and "| H100 | 4 |" in page


def test_the_summary_has_a_row_per_team_and_model() -> None:
    """Team a holds H100s, then b's job waits for them; b also runs on A100s."""
    from scheduling.simulator.metrics import ClusterInfo, TeamInfo, summarize
    from scheduling.simulator.report import render_markdown

    teams = [{"name": "a", "nominal": {"gpus": 6}}, {"name": "b", "nominal": {"gpus": 6}}]
    cluster = parse_cluster(SPEC)
    trace = [
        TraceJob("ah", 0, "a", 1, 4.0, 3600, gpu_model="H100"),
        TraceJob("ba", 0, "b", 2, 2.0, 1800, gpu_model="A100"),
        TraceJob("bh", 10, "b", 1, 2.0, 360, gpu_model="H100"),  # waits for ah: 3,590 s
    ]
    result = simulate(cluster, parse_teams(teams), trace, POLICIES["berth"])
    info = ClusterInfo(
        {n.name: n.gpus for n in cluster.nodes}, {n.name: n.gpu_model for n in cluster.nodes}
    )
    team_info = [TeamInfo("a", 6), TeamInfo("b", 6)]
    data = summarize(result.events, info, team_info, policy="berth", wall_s=0).as_dict()
    rows = {(r["team"], r["model"]): r for r in data["team_models"]}
    assert set(rows) == {("a", "H100"), ("b", "A100"), ("b", "H100")}
    assert rows["a", "H100"]["gpu_hours"] == pytest.approx(4.0)
    assert rows["b", "A100"]["gpu_hours"] == pytest.approx(2 * 2 * 0.5)
    assert rows["b", "H100"]["gpu_hours"] == pytest.approx(2 * 0.1)
    assert rows["b", "H100"]["jobs_admitted"] == 1
    assert rows["b", "H100"]["avg_first_wait_s"] == pytest.approx(3590)
    assert rows["a", "H100"]["avg_first_wait_s"] == 0
    page = render_markdown(data, title="two teams, two models")
    assert "## GPU models by team" in page and "| b | H100 | 0.2 | 1 | 3,590.0 |" in page


def test_a_job_runs_faster_on_a_faster_model_and_keeps_its_checkpointed_work() -> None:
    """gpu_speed H100: 2.0. A 3,600 s job runs 1,800 s on an H100 (the audit checks run times
    against the speeds too); a mixed gang runs at the pace of its slowest model; preempted on
    an H100 after 1,000 s with a checkpoint every 600 s of work, it keeps 1,800 s of work."""
    spec = {**SPEC, "gpu_speed": {"H100": 2.0}}
    cluster, teams = parse_cluster(spec), parse_teams(TEAMS)
    trace = [
        TraceJob("fast", 0, "a", 1, 4.0, 3600, gpu_model="H100"),
        TraceJob("slow", 0, "a", 1, 4.0, 3600, gpu_model="A100"),
        TraceJob("mixed", 4000, "a", 3, 4.0, 3600, mixed_models=True),
    ]
    pol = POLICIES["berth"]
    result = simulate(cluster, teams, trace, pol)
    audit_or_raise(result.events, cluster, teams, pol, {j.job_id: j for j in trace})
    ends = {e["job"]: e["t"] for e in result.events if e["type"] == "finish"}
    assert ends["fast"] == 1800 and ends["slow"] == 3600
    mixed = _admits(result.events)["mixed"]
    assert ends["mixed"] - mixed["t"] == pytest.approx(3600 * mixed["slowdown"])
    assert _admits(result.events)["fast"]["speed"] == 2.0

    trace = [
        TraceJob("victim", 0, "a", 1, 4.0, 7200, gpu_model="H100", checkpoint_s=600),
        TraceJob("boss", 1000, "a", 1, 4.0, 100, priority=1, gpu_model="H100"),
    ]
    pol = replace(pol, preemption_delay_s=0.0)
    result = simulate(cluster, teams, trace, pol)
    audit_or_raise(result.events, cluster, teams, pol, {j.job_id: j for j in trace})
    kept = [e["kept_s"] for e in result.events if e["type"] == "preempt"]
    assert kept == [1800.0]  # 1,000 s at speed 2 is 2,000 s of work: three checkpoints


def test_a_speed_for_a_model_no_node_has_is_refused() -> None:
    from scheduling.config import ConfigError

    with pytest.raises(ConfigError, match=r"gpu_speed: \['B200'\] is no node's gpu_model"):
        parse_cluster({**SPEC, "gpu_speed": {"B200": 4.0}})


def test_berth_tries_the_fastest_model_first_and_the_baselines_the_listed_order() -> None:
    """A100 nodes listed first, H100s twice as fast: a job that accepts any model (or lists
    A100 first) runs on an H100 under berth, on an A100 under berth-listed-models and
    kueue-tas (Kueue takes flavors in the order they are listed)."""
    spec = {**SPEC, "gpu_speed": {"H100": 2.0}}
    cluster, teams = parse_cluster(spec), parse_teams(TEAMS)
    trace = [
        TraceJob("any", 0, "a", 1, 2.0, 100),
        TraceJob("listed", 0, "a", 1, 2.0, 100, gpu_model="A100|H100"),
    ]
    for policy, model in (("berth", "H100"), ("berth-listed-models", "A100"),
                          ("kueue-tas", "A100")):  # fmt: skip
        result = simulate(cluster, teams, trace, POLICIES[policy])
        audit_or_raise(
            result.events, cluster, teams, POLICIES[policy], {j.job_id: j for j in trace}
        )
        admits = _admits(result.events)
        assert admits["any"]["gpu_model"] == admits["listed"]["gpu_model"] == model, policy
