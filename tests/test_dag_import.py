"""The DAG folder imports cleanly in Airflow's own DagBag, and its DAGs are wired as designed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from operators.lifecycle import STEPS

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
out = {"errors": {k: v[-500:] for k, v in bag.import_errors.items()}, "dags": {}}
for dag_id, dag in bag.dags.items():
    out["dags"][dag_id] = {
        t.task_id: {
            "pool": t.pool,
            "slots": t.pool_slots,
            "links": [link.name for link in t.operator_extra_links],
            "teardown": t.is_teardown,
        }
        for t in dag.tasks
    }
print("RESULT " + json.dumps(out))
"""


def test_every_dag_imports_and_is_wired(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}",
        "BERTH_HOME": str(tmp_path / "berth"),
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO / "dags")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "RESULT " in done.stdout, done.stderr[-3000:]
    got = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert got["errors"] == {}
    assert set(got["dags"]) == {"berth_job", "example_train_pipeline", "berth_maintenance"}
    assert list(got["dags"]["berth_maintenance"]) == ["sweep"]
    form = got["dags"]["berth_job"]
    assert list(form) == [f"job.{s}" for s in STEPS]
    assert STEPS == ("validate", "prepare_env", "stage_data", "wait", "run", "collect_artifacts",
                     "cleanup")  # fmt: skip
    # Waiting takes no team slot (a deferred task counts in no pool here): the run task does.
    assert form["job.wait"]["pool"] == "default_pool"
    assert form["job.run"]["links"] == ["MLflow run"]
    assert form["job.cleanup"]["teardown"] and form["job.collect_artifacts"]["teardown"]
    # Written as code, the team is known at parse time: its pool, one slot per GPU.
    runs = {k: v for k, v in got["dags"]["example_train_pipeline"].items() if k.endswith(".run")}
    assert runs and all(v["pool"].startswith("berth-") for v in runs.values())
    assert all(v["slots"] >= 1 for v in runs.values())
    waits = {k: v for k, v in got["dags"]["example_train_pipeline"].items() if k.endswith(".wait")}
    assert waits.keys() == {k[: -len("run")] + "wait" for k in runs}
