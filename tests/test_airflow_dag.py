"""The lifecycle under real Airflow 3: `dag.test()` runs every task and (inline) its triggers,
against a temporary AIRFLOW_HOME (SQLite), a temporary Berth store (SQLite) and the real local
runtime, whose replicas run the real training code. Team pools are synced against a real
`airflow api-server`.

Each DAG run happens in a fresh Python process (Airflow reads its configuration once, at
import), which prints its tasks' states; the store and the files are checked from here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dag_runs import AIRFLOW
from dag_runs import airflow_env as airflow_env_for
from dag_runs import run_dag as run_dag_test
from mlflow.tracking import MlflowClient
from mlflow_server import MlflowServer
from ports import free_port
from waiting import wait_for

from berth.store import Store
from scheduling.config import load_cluster, load_teams

REPO = Path(__file__).resolve().parent.parent

TRAIN = REPO / "dags" / "training" / "train_mlp.py"
CLUSTER = load_cluster(REPO / "config" / "local-cluster.yaml")
TEAMS = load_teams(REPO / "config" / "teams.yaml")

GANG_DAG = f"""
from airflow.sdk import DAG
from operators import gpu_job


with DAG("t_gang", schedule=None, catchup=False) as dag:
    gpu_job(
        {{
            "name": "gang",
            "team": "vision",
            "environment": {{"requirements": ["numpy"]}},
            "command": ["python", {str(TRAIN)!r}, "--epochs", "5"],
            "replicas": 2,
            "gpus_per_replica": 1,
            "memory_gb_per_replica": 1,
            "topology": "node",
            "artifacts": ["outputs/model.npz", "outputs/metrics.json"],
        }},
        group_id="train",
        poll_s=0.5,
    )
"""


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


PUBLIC_MLFLOW, PUBLIC_AIRFLOW = "https://mlflow.example.test", "https://airflow.example.test"


@pytest.fixture(scope="module")
def airflow_env(
    tmp_path_factory: pytest.TempPathFactory, mlflow_server: MlflowServer
) -> Iterator[dict[str, str]]:
    """A migrated Airflow metadata DB, a DAG folder (the repo's dags/ plus test DAGs), a
    Berth home, all in a temp dir, and a real MLflow server; the variables a task process
    needs to find them."""
    root = tmp_path_factory.mktemp("airflow")
    dags = root / "dags"
    shutil.copytree(REPO / "dags", dags, ignore=shutil.ignore_patterns("__pycache__"))
    (dags / "t_gang.py").write_text(GANG_DAG)
    env = airflow_env_for(
        root / "home",
        dags,
        root / "berth",
        MLFLOW_TRACKING_URI=mlflow_server.uri,
        # Links for browsers (an Ingress's hosts), apart from the addresses tasks use.
        BERTH_MLFLOW_PUBLIC_URL=PUBLIC_MLFLOW,
        BERTH_AIRFLOW_URL=PUBLIC_AIRFLOW,
        # the defaults: config/ of this repo, the store under BERTH_HOME
        BERTH_STORE_URL=None,
        BERTH_CLUSTER=None,
        BERTH_TEAMS=None,
    )
    yield env


def run_dag(env: dict[str, str], dag_file: str, conf: dict | None = None) -> tuple[dict, str]:
    """Run one DAG of the test DAG folder with dag.test() in a fresh process."""
    return run_dag_test(env, Path(env["AIRFLOW__CORE__DAGS_FOLDER"]) / dag_file, conf)


def store_of(env: dict[str, str]) -> Store:
    return Store(f"sqlite:///{Path(env['BERTH_HOME']) / 'berth.db'}", CLUSTER, TEAMS)


def test_gang_job_runs_the_training_and_succeeds(airflow_env: dict[str, str]) -> None:
    result, out = run_dag(airflow_env, "t_gang.py")
    assert result["state"] == "success", out[-5000:]
    assert all(state == "success" for state, _ in result["tis"].values()), result["tis"]
    assert result["tis"]["train.run"] == ["success", 1]
    with store_of(airflow_env) as store:
        [job] = [j for j in store.jobs() if j.labels.get("dag_id") == "t_gang"]
        assert job.state == "succeeded" and job.attempt == 1 and job.exit_code == 0
        assert job.labels["run_id"] == result["run_id"]
        assert job.labels["triggered_by"] == "dag_test"  # the user dag.test() runs as
        # A placement on declared GPUs: two replicas, one node (topology: node), distinct GPUs.
        assert len(job.placement) == 2 and len(job.nodes) == 1
        node = CLUSTER.by_name[job.nodes[0]]
        gpus = [g for r in job.placement for g in r.gpus]
        assert len(set(gpus)) == 2 and all(0 <= g < node.gpus for g in gpus)
        types = [e.type for e in store.events(job.id)]
        assert types[:3] == ["submit", "admit", "start"] and types[-1] == "finish"
    # The wait task queued and started the gang, and told the run task so (its XCom).
    handed = result["xcoms"]["train.wait"]
    assert (handed["status"], handed["job_id"], handed["attempt"]) == ("running", job.id, 1)
    assert handed["placement"].startswith(job.nodes[0]), handed
    # The "MLflow run" link is for a browser: the public address, not the tracking URI.
    assert handed["mlflow_url"].startswith(f"{PUBLIC_MLFLOW}/#/experiments/"), handed
    outputs = Path(airflow_env["BERTH_HOME"], "artifacts", job.id, "1", "outputs")
    metrics = json.loads((outputs / "metrics.json").read_text())
    assert metrics["world"] == 2 and metrics["accuracy"] > 0.7  # both ranks trained together
    assert (outputs / "model.npz").stat().st_size > 0
    # The replicas' lines reached the task log, from both ranks, with their GPUs.
    assert "[rank 1] rank 1/2 attempt 1" in out and "[rank 0] metrics" in out


def test_a_recoverable_exit_code_runs_the_job_again_without_a_retry(
    airflow_env: dict[str, str],
) -> None:
    """The spec declares exit code 3 recoverable and allows no retry: the first attempt exits
    3, goes back to the queue as a lost one does, and the second succeeds within the same
    Airflow try of the run task."""
    conf = {
        "name": "recover-demo",
        "team": "language",
        "command": ["python", str(TRAIN), "--epochs", "2", "--fail-on-attempt", "1"],
        "replicas": 1,
        "gpus_per_replica": 1,
        "memory_gb_per_replica": 1,
        "retries": 0,
        "recoverable_exit_codes": [3],
    }
    result, out = run_dag(airflow_env, "berth_job.py", conf)
    assert result["state"] == "success", out[-5000:]
    assert result["tis"]["job.run"] == ["success", 1]  # no Airflow retry was used
    with store_of(airflow_env) as store:
        [job] = [j for j in store.jobs() if j.labels.get("run_id") == result["run_id"]]
        assert job.state == "succeeded" and job.attempt == 2
        kinds = [e.type for e in store.events(job.id)]
        assert kinds.count("lost") == 1 and "fail" not in kinds
        [lost] = [e for e in store.events(job.id) if e.type == "lost"]
        assert lost.data["exit_code"] == 3 and lost.data["outcome"] == "lost"
    assert "is one of the job's recoverable_exit_codes" in out


def test_job_from_params_fails_once_then_succeeds_on_retry(airflow_env: dict[str, str]) -> None:
    conf = {
        "name": "retry-demo",
        "team": "language",
        "command": ["python", str(TRAIN), "--epochs", "3", "--fail-on-attempt", "1"],
        "replicas": 2,
        "gpus_per_replica": 1,
        "memory_gb_per_replica": 1,
        "retries": 1,
        "retry_backoff_s": 1,
        "artifacts": ["outputs/metrics.json"],
        "register_model": {"name": "demo-mlp"},  # the model train_mlp.py logs under "model"
    }
    result, out = run_dag(airflow_env, "berth_job.py", conf)
    assert result["state"] == "success", out[-5000:]
    assert result["tis"]["job.run"] == ["success", 2]  # the second Airflow try succeeded
    with store_of(airflow_env) as store:
        [job] = [j for j in store.jobs() if j.labels.get("run_id") == result["run_id"]]
        assert job.state == "succeeded" and job.attempt == 2 and job.team == "language"
        types = [e.type for e in store.events(job.id)]
        assert types.count("admit") == 2 and types.count("start") == 2
        assert "fail" in types or "finish" in types
    arts = Path(airflow_env["BERTH_HOME"], "artifacts", job.id)
    assert (arts / "2" / "outputs" / "metrics.json").exists()
    assert not (arts / "1" / "outputs" / "metrics.json").exists()  # attempt 1 died early
    assert "failing on attempt 1 as asked" in out
    # Attempt 1 saved epoch 1 in the job's checkpoint folder; attempt 2 resumed from it.
    assert "[rank 1] rank 1: resumed from the checkpoint of epoch 1" in out
    # MLflow: one parent run for the job, a nested run per attempt, with what each recorded.
    client = MlflowClient(airflow_env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("berth_job")  # the DAG id: the spec names none
    runs = client.search_runs([exp.experiment_id], f"tags.`berth.job_id` = '{job.id}'")
    [parent] = [r for r in runs if r.data.tags["berth.kind"] == "job"]
    attempts = {r.data.tags["berth.attempt"]: r for r in runs if r.data.tags["berth.kind"] != "job"}
    assert sorted(attempts) == ["1", "2"] and parent.info.status == "FINISHED"
    assert parent.data.metrics["attempts"] == 2
    first, second = attempts["1"], attempts["2"]
    assert {r.data.tags["mlflow.parentRunId"] for r in (first, second)} == {parent.info.run_id}
    assert first.info.status == "FAILED" and first.data.metrics["exit_status"] == 3
    assert second.info.status == "FINISHED" and second.data.metrics["exit_status"] == 0
    for run, try_number in ((first, "1"), (second, "2")):
        assert run.data.params["team"] == "language" and run.data.params["replicas"] == "2"
        assert run.data.params["placement"].startswith("local-")
        assert run.data.tags["airflow.dag_id"] == "berth_job"
        assert run.data.tags["airflow.try_number"] == try_number
        assert run.data.tags["airflow.task_url"].endswith("/tasks/job.run")
        assert run.data.tags["airflow.task_url"].startswith(f"{PUBLIC_AIRFLOW}/dags/berth_job/")
        assert run.data.metrics["queue_wait_s"] >= 0 and run.data.metrics["run_s"] > 0
    # The training code's own plain-mlflow metrics and model, and the collected artifacts.
    assert [m.step for m in client.get_metric_history(second.info.run_id, "accuracy")] == [2, 3]
    files = {a.path for a in client.list_artifacts(second.info.run_id)}
    assert {"outputs", "model"} <= files
    assert [a.path for a in client.list_artifacts(second.info.run_id, "outputs")] == [
        "outputs/metrics.json"
    ]
    # The successful attempt's model, registered as the job asked.
    [version] = client.search_model_versions("name = 'demo-mlp'")
    assert version.run_id == second.info.run_id and version.source.endswith("/model")


def test_bad_spec_fails_validate_at_once_and_queues_nothing(airflow_env: dict[str, str]) -> None:
    conf = {
        "name": "bad-job",
        "team": "vision",
        "gpus_per_replica": 1.5,
        "command": ["python train.py"],
    }
    result, out = run_dag(airflow_env, "berth_job.py", conf)
    assert result["state"] == "failed"
    assert result["tis"]["job.validate"] == ["failed", 1]  # no retry
    assert result["tis"]["job.run"][0] == "upstream_failed"
    assert "gpus_per_replica: must be a whole number >= 1" in out
    assert "command[0]: must be the program alone" in out
    with store_of(airflow_env) as store:
        assert [j for j in store.jobs() if j.labels.get("run_id") == result["run_id"]] == []
        assert [j for j in store.jobs() if j.name == "bad-job"] == []


def test_a_user_outside_the_team_is_refused_before_anything_is_queued(
    airflow_env: dict[str, str], tmp_path: Path
) -> None:
    """With BERTH_ACCESS set, the user who triggered the run (dag.test() runs as 'dag_test')
    must be one of the job's team: validate fails at once naming the user, the team and the
    fix, and nothing reaches the store."""
    access = tmp_path / "access.yaml"
    access.write_text("teams:\n  vision: [alice]\n  research: [dag_test]\n")
    conf = {"name": "not-mine", "team": "vision", "command": ["python", str(TRAIN)]}
    result, out = run_dag({**airflow_env, "BERTH_ACCESS": str(access)}, "berth_job.py", conf)
    assert result["state"] == "failed"
    assert result["tis"]["job.validate"] == ["failed", 1]  # no retry
    assert result["tis"]["job.run"][0] == "upstream_failed"
    assert "user 'dag_test' may not submit jobs to team 'vision' (your teams: research)" in out
    assert f"add 'dag_test' under teams.vision in {access}" in out
    with store_of(airflow_env) as store:
        assert [j for j in store.jobs() if j.name == "not-mine"] == []


NOTIFY_DAG = """
import json
from airflow.sdk import DAG, BaseNotifier
from operators import gpu_job


class ToFile(BaseNotifier):
    template_fields = ("text",)

    def __init__(self, path, text):
        super().__init__()
        self.path, self.text = path, text

    def notify(self, context):
        with open(self.path, "a") as f:
            f.write(json.dumps({"text": self.text, "berth": context["berth"]}) + "\\n")


class Broken(BaseNotifier):
    def notify(self, context):
        raise RuntimeError("the chat server is down")


with DAG("t_notify", schedule=None, catchup=False) as dag:
    gpu_job(
        {
            "name": "told",
            "team": "language",
            "environment": {"requirements": ["numpy"]},
            "command": ["python", TRAIN, "--epochs", "1", "--fail-on-attempt", "1"],
            "gpus_per_replica": 1,
            "retries": 1,
            "retry_backoff_s": 1,
        },
        poll_s=0.5,
        notify=[Broken(), ToFile(TOLD, "{{ berth.event }} {{ berth.job_id }} of {{ berth.team }}")],
    )
"""


def test_notifiers_hear_each_admission_and_the_failure_that_ends_the_job(
    airflow_env: dict[str, str], tmp_path: Path
) -> None:
    """Airflow notifiers given to gpu_job are told of each admission (two attempts: the
    first fails, a retry is left) and render the job's details; a notifier that fails is
    logged and changes nothing."""
    told = tmp_path / "told.jsonl"
    dags = Path(airflow_env["AIRFLOW__CORE__DAGS_FOLDER"])
    dag = NOTIFY_DAG.replace("TRAIN", repr(str(TRAIN))).replace("TOLD", repr(str(told)))
    (dags / "t_notify.py").write_text(dag)
    result, out = run_dag(airflow_env, "t_notify.py")
    assert result["state"] == "success", out[-5000:]
    lines = [json.loads(line) for line in told.read_text().splitlines()]
    assert [line["berth"]["event"] for line in lines] == ["admitted", "admitted"], lines
    job = lines[0]["berth"]["job_id"]
    assert [line["text"] for line in lines] == [f"admitted {job} of language"] * 2
    assert [line["berth"]["attempt"] for line in lines] == [1, 2]
    assert "on local-" in lines[0]["berth"]["detail"]  # where it runs
    assert "the chat server is down" in out and "1 of 2 notifier(s) told" in out


BARE_RUN_DAG = """
from airflow.sdk import DAG
from operators import BerthRunOperator

with DAG("t_bare_run", schedule=None, catchup=False) as dag:
    BerthRunOperator(
        task_id="run",
        spec={{
            "name": "bare", "team": "vision", "image": "python:3.11",
            "command": ["python", "-c", "print(1)"], "retries": 2, "gpus_per_replica": 1,
            "inputs": [{missing!r}],
        }},
        poll_s=0.5,
    )
"""


def test_a_run_task_on_its_own_stages_before_queueing_and_fails_on_a_missing_input(
    airflow_env: dict[str, str], tmp_path: Path
) -> None:
    """Without a stage step, the run task stages the inputs itself, before the job is queued:
    a missing input fails it at once (no retry: staging again cannot help) and holds nothing."""
    missing = (tmp_path / "no-such.csv").as_uri()
    dags = Path(airflow_env["AIRFLOW__CORE__DAGS_FOLDER"])
    (dags / "t_bare_run.py").write_text(BARE_RUN_DAG.format(missing=missing))
    result, out = run_dag(airflow_env, "t_bare_run.py")
    assert result["state"] == "failed"
    assert result["tis"]["run"] == ["failed", 1]  # retries: 2 in the spec, none used
    assert "the job cannot be prepared" in out and "no-such.csv" in out
    with store_of(airflow_env) as store:
        assert [j for j in store.jobs() if j.name == "bare"] == []


def test_sync_pools_against_a_real_api_server(airflow_env: dict[str, str], tmp_path: Path) -> None:
    from berth.pools import sync_pools

    port = free_port()
    passwords = tmp_path / "passwords.json"
    passwords.write_text(json.dumps({"admin": "test-password"}))
    env = {
        **airflow_env,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
    }
    log = (tmp_path / "api.log").open("w")
    server = subprocess.Popen(
        [str(AIRFLOW), "api-server", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its workers in one group, stopped together below
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert server.poll() is None, (tmp_path / "api.log").read_text()[-3000:]
        try:
            return httpx.get(f"{url}/api/v2/monitor/health", timeout=2).is_success
        except httpx.TransportError:
            return False

    try:
        wait_for(up, "the api-server to come up", 120, 0.5)
        assert sync_pools(url, "admin", "test-password", TEAMS, CLUSTER) == {
            "berth-language": "created",
            "berth-research": "created",
            "berth-vision": "created",
        }
        token = httpx.post(
            f"{url}/auth/token", json={"username": "admin", "password": "test-password"}
        ).json()["access_token"]
        head = {"Authorization": f"Bearer {token}"}
        pool = httpx.get(f"{url}/api/v2/pools/berth-vision", headers=head).json()
        assert (pool["slots"], pool["include_deferred"]) == (8, False)
        # Someone shrank a pool by hand: the next sync puts it back, and leaves the rest.
        shrunk = httpx.patch(
            f"{url}/api/v2/pools/berth-research",
            headers=head,
            json={"pool": "berth-research", "slots": 1, "include_deferred": False},
        )
        assert shrunk.is_success, shrunk.text
        again = sync_pools(url, "admin", "test-password", TEAMS, CLUSTER)
        assert again["berth-research"] == "updated" and again["berth-vision"] == "unchanged"
        pool = httpx.get(f"{url}/api/v2/pools/berth-research", headers=head).json()
        assert pool["slots"] == 2

        from berth.pools import PoolSyncError

        with pytest.raises(PoolSyncError, match="check --username and --password"):
            sync_pools(url, "admin", "wrong", TEAMS, CLUSTER)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        log.close()
