"""Example pipeline as code: prepare data -> train as a gang (2 replicas) -> evaluate.

The training step is one `gpu_job(...)` call: Berth validates the spec, builds the job's
environment, stages the data set, queues the gang for admission (team `vision`'s quota, a
placement of both replicas), runs it, retries it once (the first attempt fails on purpose, to
show a retry), collects the model and metrics and releases the GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

from airflow.sdk import DAG, task

from operators import gpu_job, task_id_in
from operators.context import settings

TRAIN = str(Path(__file__).parent / "training" / "train_mlp.py")
DATA = settings().home / "datasets" / "moons.npz"

SPEC = {
    "name": "train-moons",
    "team": "vision",
    "environment": {"requirements": ["numpy"]},
    "command": ["python", TRAIN, "--epochs", "20", "--fail-on-attempt", "1"],
    "replicas": 2,
    "gpus_per_replica": 1,
    "cpus_per_replica": 1,
    "memory_gb_per_replica": 2,
    "topology": "node",
    "retries": 1,
    "retry_backoff_s": 5,
    "inputs": [DATA.as_uri()],
    "artifacts": ["outputs/model.npz", "outputs/metrics.json"],
    "env": {"PYTHONUNBUFFERED": "1"},
}

with DAG(
    dag_id="example_train_pipeline",
    schedule=None,
    catchup=False,
    tags=["berth", "example"],
    doc_md=__doc__,
) as dag:

    @task
    def prepare_data() -> str:
        """Generate the data set the job reads (in real life: an extract from a warehouse)."""
        import runpy

        runpy.run_path(TRAIN, run_name="train_mlp")["make_data"](DATA)
        return str(DATA)

    @task
    def evaluate(ti=None) -> dict:  # Airflow passes the task instance
        """Score the trained model on fresh data; fail if it learned nothing."""
        import runpy

        import numpy as np

        result = ti.xcom_pull(task_ids=task_id_in("train", "run"))
        folder = Path(result["artifacts_dir"]) / "outputs"
        train = runpy.run_path(TRAIN, run_name="train_mlp")
        fresh = folder / "fresh.npz"
        train["make_data"](fresh, n=500, seed=1)
        data = np.load(fresh)
        params = dict(np.load(folder / "model.npz"))
        scores = train["evaluate"](params, data["x"].astype(float), data["y"].astype(float))
        reported = json.loads((folder / "metrics.json").read_text())
        if scores["accuracy"] < 0.8:
            raise ValueError(f"accuracy {scores['accuracy']:.3f} on fresh data is below 0.8")
        return {"fresh": scores, "reported": reported, "attempt": result["attempt"]}

    prepare_data() >> gpu_job(SPEC, group_id="train", poll_s=1.0) >> evaluate()
