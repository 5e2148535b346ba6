"""The demo on the embedded default: real Airflow, a real MLflow server, the real engine.

Starts MLflow (mlflow/server.sh) and Airflow standalone (scripts/airflow.sh start) with this
project's DAGs, which syncs the team pools; then launches five training jobs through Airflow's
REST API (`POST /api/v2/dags/berth_job/dagRuns`), as the trigger form would, on a declared
inventory of two nodes with four GPUs each shared by three teams (config/). Among them: gangs,
a job that must wait for its team's quota, and one that fails once and succeeds on its retry.
It follows them to the end and prints, per job, its team, queue wait, placement, attempts,
outcome and MLflow run, then where the Airflow UI is and how to log in. Work an earlier demo
left going on the same BERTH_HOME is listed and ended before the new jobs go in.

Usage: scripts/demo.sh            (this, after setting up the environment)
       scripts/demo.sh stop       (stop Airflow and MLflow)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from berth.settings import REPO_ROOT, settings
from berth.store import JobStatus, Store
from operators.release import release_job

ROOT = REPO_ROOT
TRAIN = str(ROOT / "dags" / "training" / "train_mlp.py")
# Wide enough for the tables when the output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 160)


def job(name: str, team: str, replicas: int, gpus: float, **extra: Any) -> dict[str, Any]:
    epochs = extra.pop("epochs", 2000)
    fail = extra.pop("fail_on_attempt", 0)
    command = ["python", TRAIN, "--epochs", str(epochs), "--hidden", "64"]
    if fail:
        command += ["--fail-on-attempt", str(fail)]
    return {
        "name": name,
        "team": team,
        "command": command,
        "replicas": replicas,
        "gpus_per_replica": gpus,
        "cpus_per_replica": 1,
        "memory_gb_per_replica": 2,
        "artifacts": ["outputs/model.npz", "outputs/metrics.json"],
        **extra,
    }


# Two nodes x 4 GPUs (NVLink pairs); vision 4 (+4 borrowable), language 2 (+2), research 2 (+0).
JOBS = [
    job("vision-gang", "vision", 2, 2, topology="node"),  # a 4-GPU gang on one node
    job("language-gang", "language", 2, 1, topology="gpu_group"),  # one NVLink pair
    job("research-a", "research", 1, 2),
    job("research-b", "research", 1, 2),  # research's quota is full: waits for research-a
    job("flaky", "language", 1, 1, fail_on_attempt=1, retries=1, retry_backoff_s=5),
]


class Airflow:
    """Airflow's REST API with a JWT from the simple auth manager."""

    def __init__(self, url: str, user: str, password: str) -> None:
        self.url = url
        self.http = httpx.Client()
        r = self.http.post(
            f"{url}/auth/token", json={"username": user, "password": password}, timeout=30
        )
        r.raise_for_status()
        self.http.headers["Authorization"] = f"Bearer {r.json()['access_token']}"

    def call(self, method: str, path: str, *, idempotent: bool = False, **kw: Any) -> Any:
        """One API call. `idempotent`: retried a few times on a database error (Airflow's
        SQLite database, busy while Airflow stops many tasks, answers 500 "database is
        locked" after its busy timeout); a call that is not is never repeated."""
        for wait_s in (2, 4, 8, 16, None) if idempotent else (None,):
            r = self.http.request(method, f"{self.url}/api/v2{path}", timeout=30, **kw)
            if r.status_code < 400:
                return r.json()
            if wait_s is None or r.status_code != 500 or "Database error" not in r.text:
                raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:500]}")
            time.sleep(wait_s)
        raise AssertionError("unreachable: the last try raises")

    def berth(self, path: str) -> Any:
        """The Berth plugin's REST API (plugins/berth_api), behind the same login."""
        r = self.http.get(f"{self.url}/berth/api/v1{path}", timeout=30)
        if r.status_code >= 400:
            raise RuntimeError(f"GET /berth/api/v1{path}: {r.status_code} {r.text[:500]}")
        return r.json()

    def wait_for_dag(self, dag_id: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = self.http.get(f"{self.url}/api/v2/dags/{dag_id}", timeout=30)
            if r.status_code == 200:
                return
            time.sleep(1)  # the DAG processor parses dags/ shortly after start
        raise RuntimeError(f"DAG {dag_id} not parsed in {timeout_s} s; see the Airflow logs")


def start_services(env: dict[str, str]) -> None:
    console.rule("starting MLflow and Airflow")
    subprocess.run([str(ROOT / "mlflow" / "server.sh"), "start"], env=env, check=True)
    subprocess.run([str(ROOT / "scripts" / "airflow.sh"), "start"], env=env, check=True)


def stop_services(env: dict[str, str]) -> None:
    subprocess.run([str(ROOT / "scripts" / "airflow.sh"), "stop"], env=env, check=False)
    subprocess.run([str(ROOT / "mlflow" / "server.sh"), "stop"], env=env, check=False)


ACTIVE_TASK_STATES = {"scheduled", "queued", "running", "deferred", "restarting", "up_for_retry"}


def end_earlier_runs(af: Airflow, store: Store) -> None:
    """An earlier demo on this BERTH_HOME may have left work going (Airflow resumes its runs
    when it starts again): it would take GPUs and Airflow's run slots without a word. Say what
    was found, then end it: the Airflow runs marked failed, the jobs released (replicas
    stopped, GPUs freed in the store)."""
    active = {"state": ["queued", "running"]}
    found = af.call("GET", "/dags/berth_job/dagRuns", params=active, idempotent=True)
    runs = [r["dag_run_id"] for r in found["dag_runs"]]
    jobs = [st for st in store.jobs() if not st.terminal]
    if not runs and not jobs:
        return
    console.rule("an earlier demo left work going: ending it first")
    for run_id in runs:
        path = f"/dags/berth_job/dagRuns/{run_id}"
        af.call("PATCH", path, json={"state": "failed"}, idempotent=True)
        console.print(f"  Airflow run {run_id}: marked failed")
    for st in jobs:
        state = release_job(st.id, "left by an earlier demo; ended by scripts/demo.sh")
        console.print(f"  job {st.id} (team {st.team}, was {st.state}): {state}")
    # Airflow stops those runs' task processes now: a burst of writes that, on its SQLite
    # database, made the next trigger fail with "database is locked". Go on once they ended.
    deadline = time.monotonic() + 180
    while runs and time.monotonic() < deadline:
        runs = [run_id for run_id in runs if _tasks_active(af, run_id)]
        if runs:
            time.sleep(1)
    if runs:
        console.print(f"  [yellow]tasks of {len(runs)} earlier runs still stopping; going on[/]")


def _tasks_active(af: Airflow, run_id: str) -> bool:
    got = af.call("GET", f"/dags/berth_job/dagRuns/{run_id}/taskInstances", idempotent=True)
    return any(ti["state"] in ACTIVE_TASK_STATES for ti in got["task_instances"])


def job_of(store: Store, run_id: str) -> JobStatus | None:
    for st in store.jobs():
        if st.labels.get("run_id") == run_id:
            return st
    return None


def queue_wait(store: Store, st: JobStatus) -> float | None:
    events = store.events(st.id)
    submitted = next((e.t for e in events if e.type == "submit"), None)
    admitted = next((e.t for e in events if e.type == "admit"), None)
    return None if submitted is None or admitted is None else admitted - submitted


def placement(st: JobStatus) -> str:
    return " ".join(f"{r.node}:{list(r.gpus)}" for r in st.placement) or "-"


def progress_table(runs: dict[str, str], states: dict[str, str], store: Store) -> Table:
    t = Table(title="jobs (live)")
    for col in ("job", "team", "Airflow run", "Berth state", "where it runs / why it waits"):
        t.add_column(col)
    for spec in JOBS:
        run_id = runs[spec["name"]]
        st = job_of(store, run_id)
        if st is None:
            state, where = "-", "not submitted yet"
        elif st.placement:
            state, where = st.state, placement(st)
        else:
            state, where = st.state, f"{st.reason_code or ''}: {st.reason_message or ''}"
        t.add_row(spec["name"], spec["team"], states.get(run_id, "queued"), state, where)
    return t


def main() -> int:
    s = settings()
    port = os.environ.get("AIRFLOW_PORT", "8080")
    url = f"http://localhost:{port}"
    mlflow_port = os.environ.get("MLFLOW_PORT", "5000")
    env = {
        **os.environ,
        "BERTH_HOME": str(s.home),
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
        "BERTH_AIRFLOW_URL": url,
    }
    if sys.argv[1:] == ["stop"]:
        stop_services(env)
        return 0
    os.environ.update(env)
    start_services(env)
    password = os.environ.get("BERTH_ADMIN_PASSWORD", "berth-admin")
    af = Airflow(url, "admin", password)
    af.wait_for_dag("berth_job")
    end_earlier_runs(af, settings().store())
    af.call("PATCH", "/dags/berth_job", json={"is_paused": False}, idempotent=True)
    console.rule("launching 5 jobs through the REST API")
    runs: dict[str, str] = {}
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for spec in JOBS:
        # The run is named after the job (found by name in the UI), and naming it makes the
        # POST safe to repeat: a retry of a run that was made after all answers 409.
        run_id = f"{spec['name']}-{stamp}"
        body = {
            "dag_run_id": run_id,
            "logical_date": None,
            "conf": spec,
            "note": f"Berth demo: {spec['name']} (team {spec['team']})",
        }
        try:
            af.call("POST", "/dags/berth_job/dagRuns", json=body, idempotent=True)
        except RuntimeError as e:
            if ": 409 " not in str(e):
                raise
        runs[spec["name"]] = run_id
        console.print(f"  {spec['name']:14} team {spec['team']:9} -> {run_id}")
    store = settings().store()
    states: dict[str, str] = {}
    deadline = time.monotonic() + 900
    waited: dict[str, list[str]] = {name: [] for name in runs}  # reasons seen while queued
    with Live(progress_table(runs, states, store), console=console, refresh_per_second=1) as live:
        while time.monotonic() < deadline:
            for name, run_id in runs.items():
                path = f"/dags/berth_job/dagRuns/{run_id}"
                states[run_id] = af.call("GET", path, idempotent=True)["state"]
                st = job_of(store, run_id)
                reason = st.reason_code if st is not None and st.state == "queued" else None
                if reason and reason not in waited[name]:
                    waited[name].append(reason)
            live.update(progress_table(runs, states, store))
            if all(v in ("success", "failed") for v in states.values()):
                break
            time.sleep(2)
    summary = Table(title="Berth demo: what happened")
    cols = ("job", "team", "GPUs", "queue wait", "waited for", "placement", "attempts", "outcome")
    for col in cols:
        summary.add_column(col)
    ok = True
    links = []
    for spec in JOBS:
        run_id = runs[spec["name"]]
        st = job_of(store, run_id)
        if st is None:
            summary.add_row(spec["name"], spec["team"], "", "", "", "", "", states.get(run_id, "?"))
            ok = False
            continue
        wait = queue_wait(store, st)
        summary.add_row(
            spec["name"],
            st.team,
            f"{spec['replicas']} x {spec['gpus_per_replica']}",
            "-" if wait is None else f"{wait:.1f} s",
            ", ".join(waited[spec["name"]]) or "-",
            placement(st),
            str(st.attempt),
            f"{st.state} / Airflow {states.get(run_id)}",
        )
        links.append(f"  {spec['name']:14} {mlflow_link(env['MLFLOW_TRACKING_URI'], st)}")
        ok = ok and st.state == "succeeded" and states.get(run_id) == "success"
    console.print(summary)
    console.print(teams_table(af))
    console.print("MLflow runs (one parent run per job, a nested run per attempt):")
    console.print("\n".join(links), soft_wrap=True)
    console.print(
        f"\nAirflow UI: {url}  (user admin, password {password})\n"
        f"MLflow UI:  {env['MLFLOW_TRACKING_URI']}\n"
        f"On-call:    .venv/bin/berth jobs --all; .venv/bin/berth job <id>; .venv/bin/berth usage"
        f"   (with BERTH_HOME={s.home})\n"
        f"Berth:      {url}/plugin/berth-queues (GPU queues) and {url}/plugin/berth-cluster "
        "(cluster map), in Airflow's UI and its menu\n"
        f"Berth API:  {url}/berth/api/v1/queue, /teams, /nodes, /jobs/<id> (an Airflow token: "
        f"POST {url}/auth/token); its shapes at {url}/berth/docs\n"
        f"Metrics:    {url}/berth/metrics (Prometheus)\n"
        "Airflow and MLflow keep running for you to look around; stop them with "
        "`scripts/demo.sh stop`."
    )
    return 0 if ok else 1


def teams_table(af: Airflow) -> Table:
    """The teams' quotas and use, as the Berth plugin in Airflow's API server answers them."""
    table = Table(title="Teams, from the Berth plugin (GET /berth/api/v1/teams)")
    for col in ("team", "held GPUs", "nominal", "ceiling", "borrowed", "queued", "running"):
        table.add_column(col)
    for t in af.berth("/teams")["teams"]:
        table.add_row(
            t["team"],
            f"{t['held_gpus']:g}",
            "-" if t["nominal_gpus"] is None else f"{t['nominal_gpus']:g}",
            "-" if t["ceiling_gpus"] is None else f"{t['ceiling_gpus']:g}",
            f"{t['borrowed_gpus']:g}",
            str(t["queued"]),
            str(t["running"]),
        )
    return table


def mlflow_link(tracking_uri: str, st: JobStatus) -> str:
    """The job's parent run in MLflow, found by its tag."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("berth_job")
    if exp is None:
        return "-"
    runs = client.search_runs(
        [exp.experiment_id], f"tags.`berth.job_id` = '{st.id}' and tags.`berth.kind` = 'job'"
    )
    if not runs:
        return "-"
    return f"{tracking_uri}/#/experiments/{exp.experiment_id}/runs/{runs[0].info.run_id}"


if __name__ == "__main__":
    sys.exit(main())
