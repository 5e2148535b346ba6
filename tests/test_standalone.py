"""The job lifecycle under a real Airflow deployment of the embedded default's shape.

One deployment for the module (tests/standalone_kit.py's `deployed`, on
tests/airflow_server.py): api-server, scheduler (LocalExecutor), DAG processor and triggerer,
each its own process on a SQLite metadata database, as
`airflow standalone` runs them; Berth's store is SQLite under a temp BERTH_HOME, jobs run on the
local runtime with the declared 8-GPU inventory (config/local-cluster.yaml, config/teams.yaml),
and their replicas run the real training code (dags/training/train_mlp.py). MLflow is left
out (MLFLOW_TRACKING_URI unset) to keep the deployment light; tests/test_airflow_dag.py covers it.

Each test checks what happened from the store's history (`store_workload.audit`: no GPU held by
two jobs, quotas held, each attempt admitted once; plus whole gangs here), not only from
Airflow's states:

1. twelve jobs of three teams as `gpu_job` groups in one DAG: all succeed, the history is
   clean, and the team pools (sampled through `GET /api/v2/pools` and the task instances while
   the jobs run) never hold more than their slots, and no run task is stuck waiting for a slot
   while its job holds GPUs (the deadlock decision 0005 tells of);
2. a replica killed with SIGKILL fails its gang; Airflow retries and attempt 2 succeeds;
3. the triggerer SIGKILLed while jobs wait for admission, a new one started: no GPU given twice,
   every job succeeds, and no GPU is left held.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from standalone_kit import (
    CEILINGS,
    RUN_DEADLINE_S,
    TEAMS,
    TRAIN,
    Platform,
    assert_no_replica_running,
    check_history,
    deployed,
    failure_report,
    form_dag_folder,
    jobs_of,
    wait_for_run,
)
from waiting import wait_for

from berth.store import Event, JobStatus, Store

# (name, team, replicas, GPUs per replica, topology): 19 GPUs asked of 8, by three teams
# (vision may hold 8, language 4, research 2), with gangs; the research pool (2 slots) binds.
TEAM_JOBS = [
    ("v-gang", "vision", 2, 2, "node"),
    ("v-pair", "vision", 1, 2, "any"),
    ("v-one", "vision", 1, 1, "any"),
    ("v-two", "vision", 1, 1, "any"),
    ("l-gang", "language", 2, 1, "gpu_group"),
    ("l-pair", "language", 1, 2, "any"),
    ("l-one", "language", 1, 1, "any"),
    ("l-two", "language", 1, 1, "any"),
    ("r-one", "research", 1, 1, "any"),
    ("r-two", "research", 1, 1, "any"),
    ("r-pair", "research", 1, 2, "any"),
    ("r-three", "research", 1, 1, "any"),
]

TEAMS_DAG = f"""
from airflow.sdk import DAG
from operators import gpu_job

JOBS = {TEAM_JOBS!r}

with DAG("t_teams", schedule=None, catchup=False, max_active_tasks=64) as dag:
    for name, team, replicas, gpus, topology in JOBS:
        gpu_job(
            {{
                "name": name,
                "team": team,
                "environment": {{"requirements": ["numpy"]}},
                "command": ["python", {TRAIN!r}, "--epochs", "300"],
                "replicas": replicas,
                "gpus_per_replica": gpus,
                "cpus_per_replica": 1,
                "memory_gb_per_replica": 1,
                "topology": topology,
            }},
            group_id=name,
        )
"""

# 13 GPUs asked of 8 and runs long enough that some jobs are still waiting for admission (in
# the triggerer) while others run. Run tasks alone, without gpu_job's cleanup step: a GPU the
# run task failed to release would stay held and show in Store.usage() at the end. Each
# team's jobs fit its pool together, so that only the engine makes them wait (see test 1 for
# what a full pool does).
ADMISSION_JOBS = [
    ("a-vision-gang", "vision", 2, 2),
    ("a-vision-pair", "vision", 1, 2),
    ("a-vision-one", "vision", 1, 1),
    ("a-lang-pair", "language", 1, 2),
    ("a-lang-one", "language", 1, 1),
    ("a-lang-two", "language", 1, 1),
    ("a-res-pair", "research", 1, 2),
]

ADMISSION_DAG = f"""
from airflow.sdk import DAG
from operators import BerthRunOperator

JOBS = {ADMISSION_JOBS!r}

with DAG("t_admission", schedule=None, catchup=False, max_active_tasks=64) as dag:
    for name, team, replicas, gpus in JOBS:
        BerthRunOperator(
            task_id=name,
            spec={{
                "name": name,
                "team": team,
                "environment": {{"requirements": ["numpy"]}},
                "command": ["python", {TRAIN!r}, "--epochs", "1500"],
                "replicas": replicas,
                "gpus_per_replica": gpus,
                "cpus_per_replica": 1,
                "memory_gb_per_replica": 1,
            }},
            poll_s=1.0,
        )
"""

# Attempt 1 trains "forever" (the test kills one of its replicas); attempt 2 briefly.
KILLED_COMMAND = (
    'if [ "$BERTH_ATTEMPT" = 1 ]; then e=1000000; else e=300; fi; '
    f'exec python {TRAIN} --epochs "$e"'
)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("standalone")
    dags = form_dag_folder(root)
    (dags / "t_teams.py").write_text(TEAMS_DAG)
    (dags / "t_admission.py").write_text(ADMISSION_DAG)
    extra_env = {
        # A killed triggerer's triggers go to another one within ~10 s (default 30 s).
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "10",
    }
    with deployed(root, dags, extra_env, ("t_teams", "t_admission", "berth_job")) as platform:
        yield platform


@pytest.fixture
def runs(platform: Platform) -> Iterator[list[tuple[str, str]]]:
    """The DAG runs a test triggers; one still going when the test ends (it failed) is
    ended here, so the next test starts on a quiet deployment: the run is marked failed, its
    jobs cancelled in the store (as `berth cancel` would) and their replicas stopped."""
    started: list[tuple[str, str]] = []
    yield started
    af, store = platform.airflow, platform.store
    for dag_id, run_id in started:
        if af.api.run_state(dag_id, run_id) not in ("success", "failed"):
            af.api.call("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
        for job in jobs_of(store, run_id):
            if job.terminal:
                continue
            launch = platform.runtime.reattach(job.id, job.attempt) if job.attempt else None
            if launch is not None:
                platform.runtime.stop(launch, grace_s=5)
            store.cancel(job.id, message="the test ended before the job")


# -- the tests -------------------------------------------------------------------------------


def test_twelve_jobs_of_three_teams_share_the_cluster(
    platform: Platform, runs: list[tuple[str, str]]
) -> None:
    af, store = platform.airflow, platform.store
    run_id = af.api.trigger("t_teams")
    runs.append(("t_teams", run_id))
    samples: list[tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]] = []

    stuck_since: dict[str, float] = {}

    def sample() -> None:  # the pools as Airflow reports them, and the task instances behind
        pools = {p["name"]: p for p in af.api.pools() if p["name"].startswith("berth-")}
        tis = af.api.task_instances("t_teams", run_id)
        samples.append((pools, tis))
        _fail_on_pool_deadlock(store, tis, pools, stuck_since)

    state = wait_for_run(af, "t_teams", run_id, on_poll=sample)
    tis = af.api.task_instances("t_teams", run_id)
    assert state == "success", failure_report(af, tis)
    run_tis = {ti["task_id"]: ti for ti in tis if ti["task_id"].endswith(".run")}
    assert len(run_tis) == len(TEAM_JOBS)
    assert all((ti["state"], ti["try_number"]) == ("success", 1) for ti in run_tis.values()), (
        run_tis
    )

    jobs = jobs_of(store, run_id)
    assert sorted(j.name for j in jobs) == sorted(name for name, *_ in TEAM_JOBS)
    assert {j.team for j in jobs} == set(TEAMS)
    assert all((j.state, j.attempt, j.exit_code) == ("succeeded", 1, 0) for j in jobs), [
        (j.name, j.state, j.attempt, j.message) for j in jobs
    ]
    events = store.events()
    kinds = check_history(store, events)
    assert kinds["admit"] >= len(TEAM_JOBS)
    mine = {j.id for j in jobs}
    # They ran together (the cluster was shared, not lent to one job at a time), and more was
    # asked than the cluster holds, so the engine had to make jobs wait.
    assert _peak_held(events, mine) >= 3
    assert _peak_gpus(events, mine) >= 6

    # Pools: never more slots taken than the pool has, as Airflow reports it and as the task
    # instances in the pool (running or queued: deferred tasks do not count, decision 0005)
    # add up. Deferred run tasks show in the pool's deferred slots.
    assert samples, "no pool sample was taken"
    expected = {f"berth-{t}": min(int(CEILINGS[t]), 8) for t in TEAMS}
    busiest: Counter[str] = Counter()
    for pools, sampled_tis in samples:
        assert {name: p["slots"] for name, p in pools.items()} == expected
        assert not any(p["include_deferred"] for p in pools.values()), pools
        taken: Counter[str] = Counter()
        for ti in sampled_tis:
            if ti["state"] in ("running", "queued"):
                taken[ti["pool"]] += ti["pool_slots"]
        for name, p in pools.items():
            held = p["running_slots"] + p["queued_slots"]
            assert p["occupied_slots"] <= p["slots"] and held <= p["slots"], p
            assert taken[name] <= p["slots"], (name, taken[name], sampled_tis)
            busiest[name] = max(busiest[name], held, taken[name], p["deferred_slots"])
    # The run tasks really took their team's pool (else the checks above prove nothing).
    assert all(busiest[name] > 0 for name in expected), busiest
    assert {ti["pool"] for ti in run_tis.values()} == set(expected)
    assert {ti["task_id"]: ti["pool_slots"] for ti in run_tis.values()} == {
        f"{name}.run": replicas * gpus for name, _, replicas, gpus, _ in TEAM_JOBS
    }
    assert_no_replica_running(platform)


def test_a_run_that_names_no_team_is_refused_before_anything_is_queued(platform: Platform) -> None:
    """The form has no default team (a user who did not pick one would be charged to the
    first team without noticing): Airflow's API refuses such a run, naming the field."""
    with pytest.raises(AssertionError) as e:
        platform.airflow.api.trigger("berth_job", {"name": "no-team"})
    assert "/dagRuns: 4" in str(e.value) and "team" in str(e.value)
    assert not [st for st in platform.store.jobs() if st.name == "no-team"]


def test_a_killed_replica_fails_the_gang_and_the_retry_succeeds(
    platform: Platform, runs: list[tuple[str, str]]
) -> None:
    af, store = platform.airflow, platform.store
    conf = {
        "name": "killed-replica",
        "team": "language",
        "requirements": ["numpy"],  # the environment the other tests' jobs built already
        "command": ["sh", "-c", KILLED_COMMAND],
        "replicas": 2,
        "gpus_per_replica": 1,
        "memory_gb_per_replica": 1,
        "retries": 1,
        "retry_backoff_s": 1,
        "artifacts": ["outputs/metrics.json"],
    }
    run_id = af.api.trigger("berth_job", conf)
    runs.append(("berth_job", run_id))

    def running() -> JobStatus | None:
        af.assert_alive()
        jobs = jobs_of(store, run_id)
        return jobs[0] if jobs and jobs[0].state == "running" else None

    job = wait_for(running, "the job's first attempt running", RUN_DEADLINE_S, 1.0)
    assert job.attempt == 1
    # The replica processes, from the local runtime's manifest: rank 1's wrapper, and under it
    # the training process, which dies as a crashed replica would.
    launch = wait_for(
        lambda: _with_all_pids(platform.runtime.reattach(job.id, 1)),
        "rank 1's pid in the manifest",
        60,
        0.2,
    )
    wrapper = psutil.Process(launch.replicas[1].pid)
    victim = wait_for(lambda: wrapper.children(), "rank 1's training process", 60, 0.2)[0]
    os.kill(victim.pid, signal.SIGKILL)

    state = wait_for_run(af, "berth_job", run_id)
    tis = af.api.task_instances("berth_job", run_id)
    assert state == "success", failure_report(af, tis)
    [run_ti] = [ti for ti in tis if ti["task_id"] == "job.run"]
    assert (run_ti["state"], run_ti["try_number"]) == ("success", 2)  # Airflow retried once
    # Launched from the REST API, the team only in the run's conf: the cluster policy
    # (operators/policy.py) gave the run task its team's pool, one slot per GPU; the wait
    # took no team slot.
    assert (run_ti["pool"], run_ti["pool_slots"]) == ("berth-language", 2)
    [wait_ti] = [ti for ti in tis if ti["task_id"] == "job.wait"]
    assert (wait_ti["state"], wait_ti["pool"]) == ("success", "default_pool")

    [job] = jobs_of(store, run_id)
    assert (job.state, job.attempt, job.exit_code) == ("succeeded", 2, 0)
    events = store.events(job.id)
    types = [e.type for e in events]
    assert types.count("admit") == 2 and types.count("start") == 2
    [failed] = [e for e in events if e.type == "fail"]
    assert failed.data["attempt"] == 1 and "rank" in failed.data["message"]
    assert types.index("fail") < [i for i, t in enumerate(types) if t == "admit"][1]
    # The replica we killed is the one the runtime saw die, by SIGKILL.
    exit1 = json.loads((Path(launch.dir) / "rank-1.exit.json").read_text())
    assert exit1["signal"] == signal.SIGKILL, exit1
    assert not victim.is_running()
    done = platform.berth_home / "artifacts" / job.id
    assert json.loads((done / "2" / "outputs" / "metrics.json").read_text())["world"] == 2
    check_history(store, store.events())
    assert_no_replica_running(platform)


def test_a_killed_triggerer_leaks_no_gpu_and_allocates_none_twice(
    platform: Platform, runs: list[tuple[str, str]]
) -> None:
    af, store = platform.airflow, platform.store
    run_id = af.api.trigger("t_admission")
    runs.append(("t_admission", run_id))

    def waiting_in_admission() -> bool:
        """Some jobs hold GPUs while others wait for admission in a deferred task (in the
        triggerer): the moment to kill it."""
        af.assert_alive()
        jobs = jobs_of(store, run_id)
        deferred = {
            ti["task_id"]
            for ti in af.api.task_instances("t_admission", run_id)
            if ti["state"] == "deferred"
        }
        queued = [j for j in jobs if j.state == "queued" and j.labels["task_id"] in deferred]
        holding = [j for j in jobs if j.state in ("admitted", "running")]
        return bool(queued and holding)

    wait_for(waiting_in_admission, "jobs waiting for admission while others run", 600, 0.5)
    killed_at = time.time()
    af.kill("triggerer")
    af.start("triggerer")

    state = wait_for_run(af, "t_admission", run_id)
    tis = af.api.task_instances("t_admission", run_id)
    assert state == "success", failure_report(af, tis)
    jobs = jobs_of(store, run_id)
    assert len(jobs) == len(ADMISSION_JOBS)
    assert all((j.state, j.exit_code) == ("succeeded", 0) for j in jobs), [
        (j.name, j.state, j.attempt, j.message) for j in jobs
    ]
    events = store.events()
    check_history(store, events)
    mine = {j.id for j in jobs}
    # Admission went on after the kill (under the new triggerer, or in a run task's own first
    # cycle: this does not tell which).
    assert any(e.type == "admit" and e.job_id in mine and e.t > killed_at for e in events)
    # No GPU leaked: nothing held, nothing stopping, nothing still live in the store.
    usage = store.usage()
    assert {t: (u.gpus, u.stopping_gpus) for t, u in usage.items()} == {
        t: (0.0, 0.0) for t in TEAMS
    }
    assert store.jobs(states=("queued", "admitted", "running", "preempting")) == []
    assert_no_replica_running(platform)


# -- helpers ---------------------------------------------------------------------------------


def _fail_on_pool_deadlock(
    store: Store,
    tis: list[dict[str, Any]],
    pools: dict[str, dict[str, Any]],
    stuck_since: dict[str, float],
    patience_s: float = 120,
) -> None:
    """Fail at once, saying why, when a run task whose job holds GPUs in the store has waited
    `patience_s` for a slot of its full pool: the task that would release the GPUs cannot
    resume, and the tasks holding the slots wait for those GPUs. Nothing would ever end."""
    holding = {j.labels.get("task_id"): j for j in store.jobs(states=("admitted", "running"))}
    now = time.monotonic()
    for ti in tis:
        job = holding.get(ti["task_id"])
        pool = pools.get(ti["pool"])
        if ti["state"] != "scheduled" or job is None or pool is None or pool["open_slots"] > 0:
            stuck_since.pop(ti["task_id"], None)
            continue
        since = stuck_since.setdefault(ti["task_id"], now)
        others = [t["task_id"] for t in tis if t["pool"] == ti["pool"] and t["state"] == "deferred"]
        assert now - since < patience_s, (
            f"pool deadlock: {ti['task_id']} (job {job.id}, {job.state}, holding "
            f"{len(job.placement)} replica(s)) waits {now - since:.0f} s in state scheduled for "
            f"a slot of {ti['pool']} ({pool['occupied_slots']}/{pool['slots']} occupied by "
            f"{others}), whose jobs wait in the store for the GPUs it holds"
        )


def _peak_held(events: Iterable[Event], jobs: set[str]) -> int:
    """The most of `jobs` holding GPUs at the same time, by the store's history."""
    holding: set[str] = set()
    peak = 0
    for ev in events:
        if ev.job_id not in jobs:
            continue
        if ev.type == "admit":
            holding.add(ev.job_id)
        elif ev.type in ("finish", "fail", "cancel", "requeue", "lost", "preempt"):
            holding.discard(ev.job_id)
        peak = max(peak, len(holding))
    return peak


def _peak_gpus(events: Iterable[Event], jobs: set[str]) -> int:
    """The most GPUs held by `jobs` at the same time, by the store's history."""
    held: dict[str, int] = {}
    peak = 0
    for ev in events:
        if ev.job_id not in jobs:
            continue
        if ev.type == "admit":
            held[ev.job_id] = sum(len(r["gpus"]) for r in ev.data["placement"])
        elif ev.type in ("finish", "fail", "cancel", "requeue", "lost", "preempt"):
            held.pop(ev.job_id, None)
        peak = max(peak, sum(held.values()))
    return peak


def _with_all_pids(launch: Any) -> Any:
    return launch if launch is not None and all(r.pid for r in launch.replicas) else None
