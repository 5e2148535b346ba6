"""A task's pod needs neither Airflow's metadata database nor its Fernet key.

The deployment's pod template (docker/helm/values.yaml `podTemplate`) gives task pods no
database URL and no Fernet key: Airflow 3 runs a task through its Execution API. Airflow's
supervisor hides the URL from the task's own process, "as best as possible" in its own words;
a pod that holds neither has nothing to hide (a URL would let DAG code that gets around the
block rewrite Airflow's tables, the team pools that hold Berth's quotas among them, and the key
would decrypt every stored connection). Here a task runs as the
KubernetesExecutor runs it in its pod (`python -m airflow.sdk.execution_time.execute_workload`,
the workload the executor would send: the task instance and its signed token), on Airflow's own
components (tests/standalone_kit.py), in a process with no database URL and no Fernet key, and
an Airflow home of its own (as a pod's: Airflow's default database there is an empty SQLite
file): it reads a Variable, defers to a trigger, resumes and returns its XCom. Its DAG is
paused, so that the scheduler's LocalExecutor does not run it first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standalone_kit import Platform, deployed, form_dag_folder
from waiting import wait_for

PROBE_DAG = '''
"""One task that reads a Variable, defers, and returns what its process holds."""
import os
from datetime import timedelta

from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
from airflow.sdk import DAG, BaseOperator, Variable


class Probe(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=1)), method_name="resume")

    def resume(self, context, event=None):
        return {
            "variable": Variable.get("probe"),
            "database": os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"),
            "fernet": os.environ.get("AIRFLOW__CORE__FERNET_KEY"),
        }


with DAG("db_less", schedule=None, is_paused_upon_creation=True):
    Probe(task_id="probe")
'''

# Run in the deployment's environment (it reads the metadata database): queue the task
# instance and print the workload the executor would send its pod, token included.
MAKE_WORKLOAD = """
import sys

from airflow.executors.base_executor import BaseExecutor
from airflow.executors.workloads import ExecuteTask
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session
from airflow.utils.state import TaskInstanceState

dag_id, run_id, task_id = sys.argv[1:4]
with create_session() as session:
    ti = session.query(TaskInstance).filter_by(dag_id=dag_id, run_id=run_id, task_id=task_id).one()
    ti.state = TaskInstanceState.QUEUED
    ti.try_number = max(1, ti.try_number or 0)
    session.flush()
    workload = ExecuteTask.make(ti, generator=BaseExecutor().jwt_generator)
    print(workload.model_dump_json())
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("db-less")
    dags = form_dag_folder(root)
    (dags / "db_less.py").write_text(textwrap.dedent(PROBE_DAG))
    with deployed(root, dags, {}, ["db_less"]) as platform:
        yield platform


def _run(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args[:3]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _execute_in_a_pod(platform: Platform, run_id: str, root: Path) -> None:
    """What the executor and the task's pod do: queue it, then run its workload with no
    database and no key."""
    af = platform.airflow
    script = root / "make_workload.py"
    script.write_text(MAKE_WORKLOAD)
    workload = _run([sys.executable, str(script), "db_less", run_id, "probe"], af.env)
    pod_env = {k: v for k, v in af.env.items() if not k.startswith("BERTH")}
    pod_env.pop("AIRFLOW__CORE__FERNET_KEY", None)
    pod_env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
    pod_env["AIRFLOW_HOME"] = str(root / "pod-home")  # none of the deployment's files
    module = "airflow.sdk.execution_time.execute_workload"
    line = workload.strip().splitlines()[-1]
    _run([sys.executable, "-m", module, "--json-string", line], pod_env)


def _probe(platform: Platform, run_id: str) -> dict[str, Any]:
    [ti] = platform.airflow.api.task_instances("db_less", run_id)
    return ti


def test_a_task_runs_defers_and_resumes_without_the_database_or_the_key(
    platform: Platform, tmp_path: Path
) -> None:
    af = platform.airflow
    af.api.call("POST", "/variables", json={"key": "probe", "value": "read through the API"})
    run_id = af.api.trigger("db_less")
    _execute_in_a_pod(platform, run_id, tmp_path)
    assert _probe(platform, run_id)["state"] in ("deferred", "scheduled")
    # The trigger fires (the triggerer has the database; tasks do not): the task is scheduled
    # again, and the paused DAG leaves it to us.
    wait_for(
        lambda: _probe(platform, run_id)["state"] == "scheduled", "the trigger fired", 120, 0.5
    )
    _execute_in_a_pod(platform, run_id, tmp_path)
    ti = _probe(platform, run_id)
    assert ti["state"] == "success", ti
    got = af.api.call(
        "GET",
        f"/dags/db_less/dagRuns/{run_id}/taskInstances/probe/xcomEntries/return_value",
        params={"deserialize": "true"},
    )["value"]
    if isinstance(got, str):
        got = json.loads(got)
    # Airflow's supervisor gives the task's process a URL that opens nothing, whatever the pod
    # holds; the pod here held none, and no key.
    assert got == {
        "variable": "read through the API",
        "database": "airflow-db-not-allowed:///",
        "fernet": None,
    }
    # Nothing was read or written where the pod's Airflow would look for a database.
    assert not (tmp_path / "pod-home" / "airflow.db").exists() or _tables(tmp_path) == []


def _tables(root: Path) -> list[str]:
    import sqlite3

    with sqlite3.connect(root / "pod-home" / "airflow.db") as db:
        return [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
