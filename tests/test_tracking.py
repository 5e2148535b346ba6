"""Job and attempt runs in a real MLflow server (started by the tests, SQLite backend)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow_server import MlflowServer

from berth.settings import BerthSettings
from berth.tracking import JobTracker

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


def _open(tracker: JobTracker, job_id: str, attempt: int, experiment: str = "berth-tests"):
    return tracker.open_attempt(
        job_id=job_id,
        job_name="train",
        experiment=experiment,
        attempt=attempt,
        params={"team": "vision", "replicas": 2, "placement": [{"node": "n0", "gpus": [0, 1]}]},
        tags={"airflow.dag_id": "berth_job", "airflow.try_number": str(attempt)},
    )


def test_one_parent_run_and_a_nested_run_per_attempt(server, tmp_path):
    tracker = JobTracker(server.uri, tmp_path / "spool")
    first = _open(tracker, "job-a", 1)
    tracker.close_attempt(first, "failed", {"exit_status": 3, "queue_wait_s": 1.5})
    second = _open(tracker, "job-a", 2)
    again = _open(tracker, "job-a", 2)  # a resumed task finds its run again
    assert again == second
    tracker.close_attempt(second, "succeeded", {"exit_status": 0, "run_s": 4.0})
    tracker.close_job(second, "succeeded", attempts=2)

    client = MlflowClient(server.uri)
    # The UI opens it as model training, not as a GenAI experiment.
    kind = client.get_experiment(first.experiment_id).tags.get("mlflow.experimentKind")
    assert kind == "custom_model_development"
    runs = client.search_runs([first.experiment_id], "tags.`berth.job_id` = 'job-a'")
    by_kind = {}
    for r in runs:
        by_kind.setdefault(r.data.tags["berth.kind"], []).append(r)
    assert len(by_kind["job"]) == 1 and len(by_kind["attempt"]) == 2
    parent = by_kind["job"][0]
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["attempts"] == 2
    attempts = {r.data.tags["berth.attempt"]: r for r in by_kind["attempt"]}
    assert {r.data.tags["mlflow.parentRunId"] for r in attempts.values()} == {parent.info.run_id}
    assert attempts["1"].info.status == "FAILED"
    assert attempts["1"].data.metrics["exit_status"] == 3
    assert attempts["2"].info.status == "FINISHED"
    assert attempts["2"].data.params["team"] == "vision"
    assert "'gpus': [0, 1]" in attempts["2"].data.params["placement"]
    assert attempts["2"].data.tags["airflow.try_number"] == "2"


def test_a_replica_logs_to_its_attempt_with_plain_mlflow(server, tmp_path):
    tracker = JobTracker(server.uri, tmp_path / "spool")
    run = _open(tracker, "job-b", 1)
    code = (
        "import mlflow\n"
        "with mlflow.start_run():\n"  # resumes MLFLOW_RUN_ID: no platform code in training
        "    for step in range(5):\n"
        "        mlflow.log_metric('loss', 1.0 / (step + 1), step=step)\n"
    )
    env = {**os.environ, **tracker.attempt_env(run), "MLFLOW_SYSTEM_METRICS_NODE_ID": "n0-rank1"}
    env["MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"] = "false"  # see test_system_metrics.py
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path, timeout=120)
    history = MlflowClient(server.uri).get_metric_history(run.run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2, 3, 4]
    assert history[-1].value == pytest.approx(0.2)


def test_twelve_jobs_logging_at_once_lose_no_metric(server, tmp_path):
    tracker = JobTracker(server.uri, tmp_path / "spool")
    runs = [_open(tracker, f"job-c{i}", 1) for i in range(12)]
    code = (
        "import mlflow\n"
        "with mlflow.start_run():\n"
        "    for step in range(40):\n"
        "        mlflow.log_metric('acc', step, step=step)\n"
    )

    def replica(run) -> int:
        env = {**os.environ, **tracker.attempt_env(run)}
        env["MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"] = "false"
        return subprocess.run([sys.executable, "-c", code], env=env, timeout=300).returncode

    with ThreadPoolExecutor(max_workers=12) as pool:
        assert list(pool.map(replica, runs)) == [0] * 12
    client = MlflowClient(server.uri)
    for run in runs:
        assert sorted(m.step for m in client.get_metric_history(run.run_id, "acc")) == list(
            range(40)
        )


def test_the_record_waits_out_a_server_outage(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast while it is away
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    srv = MlflowServer(tmp_path / "server")
    srv.start()
    try:
        tracker = JobTracker(srv.uri, tmp_path / "spool")
        run = _open(tracker, "job-d", 1)
        srv.stop()
        # The job ran while the server was away: closing it neither raises nor loses anything.
        tracker.close_attempt(run, "succeeded", {"run_s": 12.0, "exit_status": 0})
        tracker.close_job(run, "succeeded", attempts=1)
        assert len(tracker.spool) == 6  # metrics, tag, end, for the attempt and the job
        assert tracker.flush() == 0  # still away: nothing lost, nothing applied
        srv.start()
        assert tracker.flush() == 6
        assert len(tracker.spool) == 0
        got = MlflowClient(srv.uri).get_run(run.run_id)
        assert got.info.status == "FINISHED"
        assert got.data.metrics["run_s"] == 12.0
        assert got.data.tags["berth.outcome"] == "succeeded"
    finally:
        srv.stop()


def test_the_mlflow_folder_does_not_shadow_the_library():
    out = subprocess.run(
        [sys.executable, "-c", "import mlflow; print(mlflow.__file__)"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert "site-packages" in out.stdout
    assert not (REPO / "mlflow" / "__init__.py").exists()


def test_register_model_adds_a_version_per_success_and_names_a_missing_path(server, tmp_path):
    from berth.tracking import TrackingError

    tracker = JobTracker(server.uri, tmp_path / "spool")
    run = _open(tracker, "job-e", 1)
    with pytest.raises(TrackingError, match=r"register_model.path: .* no artifacts under 'model'"):
        tracker.register_model(run, "reg-test", "model")
    out = tmp_path / "m"
    out.mkdir()
    (out / "weights.bin").write_bytes(b"\x00" * 64)
    tracker.client.log_artifacts(run.run_id, str(out), "model")
    assert tracker.register_model(run, "reg-test", "model") == "1"
    assert tracker.register_model(run, "reg-test", "model") == "2"  # the name exists: a version
    [first, *_] = MlflowClient(server.uri).search_model_versions("name = 'reg-test'")
    assert first.tags["berth.job_id"] == "job-e"


def test_a_replica_trains_through_a_server_outage_and_loses_no_metric(tmp_path):
    srv = MlflowServer(tmp_path / "server")
    srv.start()
    try:
        tracker = JobTracker(srv.uri, tmp_path / "spool")
        run = _open(tracker, "job-f", 1)
        code = (
            "import sys, time, mlflow\n"
            "with mlflow.start_run():\n"
            "    for step in range(20):\n"
            "        mlflow.log_metric('loss', 1.0 / (step + 1), step=step)\n"
            "        time.sleep(0.25)\n"  # a training step's work, while the server is away
            "        if step == 3:\n"
            "            print('step 3', flush=True)\n"
            "print('trained', flush=True)\n"
        )
        env = {**os.environ, **tracker.attempt_env(run)}
        env["MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"] = "false"
        replica = subprocess.Popen(
            [sys.executable, "-c", code], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True
        )
        assert replica.stdout is not None and replica.stdout.readline().strip() == "step 3"
        srv.stop()  # the server goes away mid-training ...
        time.sleep(4)  # ... for a few seconds of wall time (what is being tested: an outage)
        srv.start()
        out, _ = replica.communicate(timeout=300)
        assert replica.returncode == 0 and "trained" in out
        history = MlflowClient(srv.uri).get_metric_history(run.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(20))
    finally:
        srv.stop()


# -- links a browser opens: BERTH_MLFLOW_PUBLIC_URL, BERTH_AIRFLOW_URL -------------------------


def test_links_use_the_public_addresses_and_fall_back_to_the_tracking_uri(tmp_path: Path) -> None:
    inside = {"BERTH_HOME": str(tmp_path), "MLFLOW_TRACKING_URI": "http://mlflow.ns.svc:5000"}
    s = BerthSettings.from_env(inside)
    assert s.mlflow_ui_url == "http://mlflow.ns.svc:5000"  # no public one: the same server
    public = {
        **inside,
        "BERTH_MLFLOW_PUBLIC_URL": "https://mlflow.example.com/",
        "BERTH_AIRFLOW_URL": "https://airflow.example.com",
    }
    s = BerthSettings.from_env(public)
    assert s.mlflow_ui_url == "https://mlflow.example.com"
    assert s.tracking_uri == "http://mlflow.ns.svc:5000"  # tasks still talk to it inside
    assert s.airflow_url == "https://airflow.example.com"
    assert BerthSettings.from_env({"BERTH_HOME": str(tmp_path)}).mlflow_ui_url is None


@pytest.mark.parametrize("var", ["BERTH_MLFLOW_PUBLIC_URL", "BERTH_AIRFLOW_URL"])
@pytest.mark.parametrize("url", ["mlflow.example.com", "ftp://x.example.com", "https://x/?a=1"])
def test_a_public_address_that_no_browser_opens_is_refused(
    tmp_path: Path, var: str, url: str
) -> None:
    with pytest.raises(ValueError) as err:
        BerthSettings.from_env({"BERTH_HOME": str(tmp_path), var: url})
    assert var in str(err.value) and "https://" in str(err.value)
