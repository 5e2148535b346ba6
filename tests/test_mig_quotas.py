"""`mig.<profile>` quota keys (decision 0024): a team's quota of one MIG profile's instances,
enforced beside its `gpus` (where the instances count by their compute share) as `gpus.<MODEL>`
keys are, with borrowing, lending and reclaim per key; the audit checks every key."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import World, admitted
from test_mig import CLUSTER, mig_job
from test_mig_discovery import CLUSTER as LIVE_CLUSTER
from typer.testing import CliRunner

from berth.cli import app
from berth.spec import JobSpec, parse_spec
from berth.store import Store
from scheduling.admission import check_job
from scheduling.config import ConfigError, parse_teams
from scheduling.models import check_team_models
from scheduling.simulator.audit import audit, audit_or_raise
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import TraceJob
from scheduling.simulator.workloads import build

M1 = "1g.10gb"  # CLUSTER has 9 of them (2 on m0's GPU 0, 7 on its GPU 1) and one 3g.40gb


def _teams(*specs: dict) -> dict:
    return parse_teams(list(specs))


def test_keys_count_instances_and_mistakes_name_the_key_and_the_fix() -> None:
    t = _teams(
        {
            "name": "a",
            "nominal": {"gpus": 4, "mig.1g.10gb": 4},
            "borrowing_limit": {"mig.1g.10gb": 1},
            "lending_limit": {"mig.1g.10gb": 2},
        }
    )["a"]
    (q,) = t.models
    assert (q.model, q.nominal, q.ceiling, q.lends, q.guaranteed) == (
        "mig.1g.10gb", 4000, 5000, 2000, 2000,
    )  # fmt: skip
    bad = [
        ({"gpus": 4, "mig.1g": 1}, "mig.1g: '1g' is not a MIG profile"),
        ({"gpus": 4, "mig.1g.10gb": 1.5}, "not a whole number of instances >= 0"),
        ({"gpus": 4, "mig.1g.10gb": -1}, "not a whole number of instances >= 0"),
        ({"gpus": 4, "migs.1g.10gb": 1}, "mig.<profile> for one MIG profile's instances"),
    ]
    for nominal, words in bad:
        with pytest.raises(ConfigError, match=r"teams\.0\.nominal") as e:
            _teams({"name": "a", "nominal": nominal})
        assert words in str(e.value)
    with pytest.raises(ConfigError, match=r"lending_limit\.mig\.1g\.10gb exceeds its nominal"):
        _teams({"name": "a", "nominal": {"mig.1g.10gb": 1}, "lending_limit": {"mig.1g.10gb": 2}})
    with pytest.raises(ConfigError, match=r"per-model keys \(mig\.1g\.10gb\) are a team's"):
        parse_teams(
            {
                "teams": [{"name": "a", "nominal": {"gpus": 1}, "cohort": "d"}],
                "cohorts": [{"name": "d", "nominal": {"mig.1g.10gb": 2}}],
            }
        )
    check_team_models(CLUSTER, _teams({"name": "a", "nominal": {"mig.2g.20gb": 1}}))  # m0 has one
    with pytest.raises(ConfigError) as e:
        check_team_models(CLUSTER, _teams({"name": "a", "nominal": {"mig.1g.5gb": 1}}))
    assert (
        "no node has MIG instances of mig.1g.5gb; the cluster's profiles are 1g.10gb, "
        "2g.20gb, 3g.40gb" in str(e.value)
    )


def test_a_team_stays_within_its_profiles_ceiling() -> None:
    teams = _teams(
        {"name": "a", "nominal": {"gpus": 8, "mig.1g.10gb": 2},
         "borrowing_limit": {"mig.1g.10gb": 0}},
        {"name": "b", "nominal": {"gpus": 8}},
    )  # fmt: skip
    w = World(CLUSTER, teams)
    w.submit(*(mig_job(f"a{i}", "a", 1, M1) for i in range(3)), mig_job("big", "a", 1, "3g.40gb"))
    result = w.cycle(0)
    # Two 1g instances (its nominal, no borrowing); another profile's is not limited by it.
    assert sorted(admitted(result)) == ["a0", "a1", "big"]
    reason = result.pending["a2"]
    assert reason.resource == "mig.1g.10gb" and "borrowing_limit" in reason.message
    assert w.state.quota.model_usage[("a", "mig.1g.10gb")] == 2000
    # Three instances at once its key can never hold: refused at submission, naming the field.
    rejected = check_job(mig_job("three", "a", 3, M1), CLUSTER, teams)
    assert rejected is not None
    assert rejected.field == "mig_profile" and "at most 2 (mig.1g.10gb" in rejected.message


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_a_team_takes_back_the_instances_it_lent(policy: str) -> None:
    """b borrows 1g instances from a's nominal of them (b declares no key: a nominal of 0,
    within its total nominal); a's 1g jobs reclaim two of them, by the profile's key, though b
    borrows nothing in total."""
    teams = _teams(
        {"name": "a", "nominal": {"gpus": 4, "mig.1g.10gb": 4}},
        {"name": "b", "nominal": {"gpus": 4}},
    )
    w = World(CLUSTER, teams, POLICIES[policy])
    w.submit(*(mig_job(f"b{i}", "b", 1, M1) for i in range(9)))
    assert len(admitted(w.cycle(0))) == 9
    w.submit(mig_job("a0", "a", 1, M1), mig_job("a1", "a", 1, M1), at=10)
    early = w.cycle(10)
    delay = w.policy.preemption_delay_s
    if delay:
        assert not early.admitted and early.pending["a0"].resource == "mig.1g.10gb"
        early = w.cycle(10 + delay)
    assert sorted(admitted(early)) == ["a0", "a1"]
    assert len(early.preempted) == 2 and {p.by for p in early.preempted} == {"a0", "a1"}
    assert w.state.quota.model_usage[("a", "mig.1g.10gb")] == 2000


@pytest.mark.parametrize("policy", ["berth", "kueue-tas", "quota-spread"])
def test_a_replay_keeps_every_profile_key_and_the_audit_checks_it(policy: str) -> None:
    teams = _teams(
        {"name": "a", "nominal": {"gpus": 4, "mig.1g.10gb": 5}, "borrowing_limit": {"gpus": 4}},
        {"name": "b", "nominal": {"gpus": 4, "mig.1g.10gb": 1},
         "borrowing_limit": {"mig.1g.10gb": 2}},
    )  # fmt: skip
    trace = [
        TraceJob(f"m{i}", float(i), "ab"[i % 2], 1 + i % 2, 0.143, 300.0 + 40 * i, mig_profile=M1)
        for i in range(14)
    ]
    trace += [TraceJob("whole", 1.0, "b", 2, 1.0, 400.0)]
    jobs = {j.job_id: j for j in trace}
    result = simulate(CLUSTER, teams, trace, POLICIES[policy])
    audit_or_raise(result.events, CLUSTER, teams, POLICIES[policy], jobs)
    assert {e["job"] for e in result.events if e["type"] == "finish"} == set(jobs)
    if POLICIES[policy].gangs.holds_partial:
        return  # such a policy does not enforce per-model keys (decision 0022)
    # The same jobs replayed without the keys: b takes more than 3 instances, and the audit,
    # told the keys, says so.
    loose = _teams({"name": "a", "nominal": {"gpus": 4}}, {"name": "b", "nominal": {"gpus": 4}})
    rush = [TraceJob(f"r{i}", 0.0, "b", 1, 0.143, 500.0, mig_profile=M1) for i in range(5)]
    free = simulate(CLUSTER, loose, rush, POLICIES[policy])
    found = audit(free.events, CLUSTER, teams, POLICIES[policy], {j.job_id: j for j in rush})
    messages = " | ".join(v.message for v in found)
    assert {v.rule for v in found} == {"quota"}
    assert "uses 4 mig.1g.10gb, above its nominal + borrowing_limit of 3" in messages


def _berth_check(folder: Path, cluster: str, teams: str) -> str:
    """`berth check` on these cluster and teams files; its output on one line."""
    (folder / "cluster.yaml").write_text(cluster)
    (folder / "teams.yaml").write_text(teams)
    got = CliRunner().invoke(
        app,
        ["check", "--cluster", str(folder / "cluster.yaml"), "--teams",
         str(folder / "teams.yaml")],
    )  # fmt: skip
    assert got.exit_code == 0, got.output
    return " ".join(got.output.split())


def test_berth_check_explains_the_profile_keys(tmp_path: Path) -> None:
    out = _berth_check(
        tmp_path,
        "nodes:\n  - {name: m0, gpus: 2, gpu_model: A100, mig: {1: [1g.10gb, 1g.10gb, 1g.10gb]}}\n",
        "teams:\n  - {name: a, nominal: {gpus: 0.2, mig.1g.10gb: 2}}\n  - {name: b, nominal: "
        "{gpus: 1}}\n",
    )
    assert "mig.1g.10gb: nominal 2, borrowing_limit no limit, lends 2" in out
    assert "mig.1g.10gb: no key of its own: borrows it from the pool" in out  # team b
    assert "its mig.<profile> nominals come to 0.286 GPUs by compute share, more than its " in out
    assert "no nominal of gpus.A100" not in out  # no team declares the model: nothing to say


def test_berth_check_says_a_profile_on_a_model_it_only_borrows_is_not_reclaimable(
    tmp_path: Path,
) -> None:
    """Team a's instances sit on A100s, a model b holds a key for and a has none of: a uses
    them by borrowing the A100, so it may not reclaim them (decision 0024); check says so, and
    says nothing once a declares the model too."""

    def check(a_nominal: str) -> str:
        return _berth_check(
            tmp_path,
            "nodes:\n  - {name: m0, gpus: 2, gpu_model: A100, mig: {1: [3g.40gb, 3g.40gb]}}\n",
            f"teams:\n  - {{name: a, nominal: {{{a_nominal}}}}}\n"
            "  - {name: b, nominal: {gpus: 1, gpus.A100: 1}}\n",
        )

    out = check("gpus: 1, mig.3g.40gb: 2")
    assert (
        "note: its mig.3g.40gb instances are on A100 GPUs and it has no nominal of gpus.A100: "
        "it uses them by borrowing the model, so it may not reclaim them from a team that holds "
        "them; declare gpus.A100 to cover them"
    ) in out
    assert "no nominal of gpus.A100" not in check("gpus: 1, gpus.A100: 1, mig.3g.40gb: 2")


def test_the_store_waits_on_the_key_and_shows_each_teams_instances(tmp_path: Path) -> None:
    teams = _teams(
        {"name": "a", "nominal": {"gpus": 2, "mig.1g.10gb": 2},
         "borrowing_limit": {"mig.1g.10gb": 0}},
    )  # fmt: skip
    # One A100 node with three 1g instances, CPUs and memory declared (the spec asks for some).
    store = Store(f"sqlite:///{tmp_path}/berth.db", LIVE_CLUSTER, teams, POLICIES["berth"])
    try:
        for i in range(3):
            store.submit(_spec(f"m{i}"), job_id=f"m{i}", now=0.0)
        store.schedule(now=1.0)
        assert [store.status(f"m{i}").state for i in range(3)] == ["admitted"] * 2 + ["queued"]
        waiting = store.status("m2")
        assert waiting.reason_resource == "mig.1g.10gb" and "borrowing_limit" in (
            waiting.reason_message or ""
        )
        rows = {m.model: m for m in store.usage()["a"].models}
        assert (rows["mig.1g.10gb"].gpus, rows["mig.1g.10gb"].nominal) == (2.0, 2.0)
        assert rows["A100"].gpus == pytest.approx(0.286)  # two instances' compute share
    finally:
        store.close()


def _spec(name: str) -> JobSpec:
    return parse_spec(
        {"name": name, "team": "a", "image": "ghcr.io/o/t:1", "command": ["python", "t.py"],
         "mig_profile": M1}
    )  # fmt: skip


@pytest.mark.parametrize("policy", ["berth", "kueue-tas"])
def test_the_mig_family_replays_within_every_key(policy: str) -> None:
    """The quality benchmark's `mig` workload (instances beside whole GPUs, profile keys for
    the inference team), a short run of it, audited: every key kept, every reclaim of a
    profile a reclaim, no instance given twice, every job finished."""
    work = build("mig", 1, jobs=300)
    result = simulate(work.cluster, work.teams, work.jobs, POLICIES[policy])
    jobs = {j.job_id: j for j in work.jobs}
    audit_or_raise(result.events, work.cluster, work.teams, POLICIES[policy], jobs)
    assert {e["job"] for e in result.events if e["type"] == "finish"} == set(jobs)
    assert {q.model for q in work.teams["serve"].models} == {"mig.1g.10gb", "mig.3g.40gb"}
    assert sum(1 for j in work.jobs if j.mig_profile) >= 60
