"""The cluster shape of tracking: MLflow with a PostgreSQL backend store and an S3 artifact
destination (moto's S3 server over real HTTP), artifacts proxied through the MLflow server."""

from __future__ import annotations

import hashlib

import pytest
from mlflow.tracking import MlflowClient
from mlflow_server import MlflowServer
from pg import PostgresServer, postgres  # noqa: F401 (the session fixture)
from s3server import CREDENTIALS, S3Server

from berth.tracking import JobTracker


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.client().create_bucket(Bucket="mlflow")
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresServer, s3: S3Server):  # noqa: F811
    url = postgres.new_database()
    srv = MlflowServer(
        tmp_path_factory.mktemp("mlflow-pg"),
        backend_uri=url,
        artifacts_destination="s3://mlflow/artifacts",
        env={**CREDENTIALS, "MLFLOW_S3_ENDPOINT_URL": s3.endpoint_url},
    )
    srv.start()
    yield srv
    srv.stop()


def test_attempts_and_artifacts_land_in_postgres_and_s3(server, s3, tmp_path):
    tracker = JobTracker(server.uri, tmp_path / "spool")
    runs = []
    for attempt, outcome in ((1, "failed"), (2, "succeeded")):
        run = tracker.open_attempt(
            job_id="job-pg",
            job_name="train",
            experiment="berth-scale",
            attempt=attempt,
            params={"team": "vision", "gpus_per_replica": 1.0},
            tags={"airflow.dag_id": "berth_job"},
        )
        out = tmp_path / f"a{attempt}"
        out.mkdir()
        (out / "model.bin").write_bytes(bytes(range(256)) * 64 * attempt)
        tracker.log_artifacts(run, out)
        tracker.close_attempt(run, outcome, {"exit_status": 0 if attempt == 2 else 1})
        runs.append(run)
    tracker.close_job(runs[-1], "succeeded", attempts=2)

    client = MlflowClient(server.uri)
    found = client.search_runs([runs[0].experiment_id], "tags.`berth.job_id` = 'job-pg'")
    kinds = sorted(r.data.tags["berth.kind"] for r in found)
    assert kinds == ["attempt", "attempt", "job"]
    assert client.get_run(runs[0].run_id).info.status == "FAILED"
    assert client.get_run(runs[1].run_id).info.status == "FINISHED"
    # The artifact went through the server into the S3 bucket, byte for byte.
    assert [a.path for a in client.list_artifacts(runs[1].run_id)] == ["model.bin"]
    objects = s3.client().list_objects_v2(Bucket="mlflow", Prefix="artifacts/")["Contents"]
    keys = [o["Key"] for o in objects if o["Key"].endswith(f"{runs[1].run_id}/artifacts/model.bin")]
    assert len(keys) == 1
    body = s3.client().get_object(Bucket="mlflow", Key=keys[0])["Body"].read()
    expected = (tmp_path / "a2" / "model.bin").read_bytes()
    assert hashlib.sha256(body).hexdigest() == hashlib.sha256(expected).hexdigest()
