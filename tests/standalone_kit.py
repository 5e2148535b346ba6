"""What the tests of a real Airflow deployment of the embedded default's shape share
(test_standalone.py, test_standalone_lifecycle.py, test_triggerer_failover.py): the deployment
itself (`deployed`: api-server, scheduler, DAG processor and triggerer on SQLite, Berth's
store under a temp BERTH_HOME, the local runtime on config/local-cluster.yaml), the trigger
form's DAG folder, and the checks: a run's end with every component alive, the store's
history audited with whole gangs, no replica left running."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_server import AirflowDeployment
from store_workload import audit
from waiting import wait_for

from berth.runtime import LocalRuntime
from berth.store import Event, JobStatus, Store
from scheduling.config import load_cluster, load_teams
from scheduling.resources import Resources

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "dags" / "training" / "train_mlp.py")
CLUSTER = load_cluster(REPO / "config" / "local-cluster.yaml")
TEAMS = load_teams(REPO / "config" / "teams.yaml")
CEILINGS = {name: Resources(t.ceiling.gpu).as_units()["gpus"] for name, t in TEAMS.items()}
# Generous: a shared 2-core machine may run these while other suites run too.
RUN_DEADLINE_S = 600


@dataclass
class Platform:
    airflow: AirflowDeployment
    store: Store
    berth_home: Path

    @property
    def runtime(self) -> LocalRuntime:
        return LocalRuntime(self.berth_home / "runs")


def form_dag_folder(root: Path) -> Path:
    """`root/dags` with the trigger form's DAG (`berth_job`) and the demo's training code."""
    dags = root / "dags"
    dags.mkdir()
    shutil.copy(REPO / "dags" / "berth_job.py", dags / "berth_job.py")
    shutil.copytree(
        REPO / "dags" / "training", dags / "training", ignore=shutil.ignore_patterns("__pyc*")
    )
    return dags


@contextmanager
def deployed(
    root: Path, dags: Path, extra_env: dict[str, str], dag_ids: Iterable[str]
) -> Iterator[Platform]:
    """The four components on `dags`, Berth's store under `root/berth`, until the block ends;
    the DAGs parsed and the team pools made by the API server's plugin (no sync by hand)."""
    berth_home = root / "berth"
    airflow = AirflowDeployment(
        root,
        dags,
        berth_home,
        extra_env={
            # Few task processes at once on a 2-core machine (each is a Python interpreter).
            "AIRFLOW__CORE__PARALLELISM": "6",
            # The DAG files do not change: parse them once, not every 30 s.
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
            **extra_env,
        },
    )
    store: Store | None = None
    try:
        airflow.start_all()
        berth_home.mkdir(parents=True, exist_ok=True)
        store = Store(f"sqlite:///{berth_home / 'berth.db'}", CLUSTER, TEAMS)
        for dag_id in dag_ids:
            wait_for(lambda d=dag_id: airflow.api.dag_known(d), f"DAG {dag_id} parsed", 300, 1.0)
        pools = {f"berth-{t}" for t in TEAMS}
        wait_for(
            lambda: pools <= {p["name"] for p in airflow.api.pools()}, "the team pools", 120, 1.0
        )
        yield Platform(airflow, store, berth_home)
    finally:
        airflow.stop()
        stop_leftover_replicas(LocalRuntime(berth_home / "runs"), berth_home / "runs")
        if store is not None:
            store.close()


def wait_for_run(
    af: AirflowDeployment,
    dag_id: str,
    run_id: str,
    on_poll: Callable[[], None] | None = None,
    timeout_s: float = RUN_DEADLINE_S,
) -> str:
    """The DAG run's final state; checks that every component still runs while waiting."""

    def done() -> str | None:
        af.assert_alive()
        if on_poll is not None:
            on_poll()
        state = af.api.run_state(dag_id, run_id)
        return state if state in ("success", "failed") else None

    def report() -> str:
        return failure_report(af, af.api.task_instances(dag_id, run_id))

    what = f"DAG run {dag_id}/{run_id} finished"
    try:
        return str(wait_for(done, what, timeout_s, every=1.0, detail=report))
    except AssertionError as e:  # a component died, or the API refused a call
        raise AssertionError(f"{e}\n{report()}") from None


def failure_report(af: AirflowDeployment, tis: Iterable[dict[str, Any]]) -> str:
    states = {ti["task_id"]: (ti["state"], ti["try_number"]) for ti in tis}
    return f"task instances: {states}\n{af.log_tails()}"


def jobs_of(store: Store, run_id: str) -> list[JobStatus]:
    return [j for j in store.jobs() if j.labels.get("run_id") == run_id]


def check_history(store: Store, events: list[Event]) -> Counter:
    """The audit (no GPU given twice or used by two running jobs, quotas held, each attempt
    admitted once), and whole gangs: every admission placed every replica with all its GPUs."""
    kinds = audit(events, CEILINGS)
    specs = {j.id: j.spec for j in store.jobs()}
    for ev in events:
        if ev.type != "admit":
            continue
        spec = specs[ev.job_id]
        placed = ev.data["placement"]
        assert len(placed) == spec.replicas, f"event {ev.id}: partial gang {ev.job_id}: {placed}"
        for replica in placed:
            assert len(replica["gpus"]) == spec.gpus_per_replica, f"event {ev.id}: {replica}"
    return kinds


def attempts_of(runs: Path) -> Iterator[tuple[str, int]]:
    for manifest in sorted(runs.glob("*/attempt-*/manifest.json")):
        yield manifest.parent.parent.name, int(manifest.parent.name.removeprefix("attempt-"))


def assert_no_replica_running(platform: Platform) -> None:
    """Every gang the runtime launched has ended (replicas detach from Airflow's processes,
    so a leak would outlive the tasks)."""
    runtime = platform.runtime
    alive = []
    for job_id, attempt in attempts_of(platform.berth_home / "runs"):
        launch = runtime.reattach(job_id, attempt)
        if launch is not None and runtime.poll(launch).state == "running":
            alive.append((job_id, attempt))
    assert alive == [], f"replicas still running: {alive}"


def stop_leftover_replicas(runtime: LocalRuntime, runs: Path) -> None:
    """After a failed test: stop any gang still running, so no process outlives the module."""
    for job_id, attempt in attempts_of(runs):
        launch = runtime.reattach(job_id, attempt)
        if launch is not None and runtime.poll(launch).state == "running":
            runtime.stop(launch, grace_s=5)
