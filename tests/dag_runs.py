"""`dag.test()` in a fresh Python process (Airflow reads its configuration once, at import), for
the tests that run a DAG: an environment with a migrated Airflow database, and the run's result
as the driver prints it (state, each task's state and try number, each task's XCom)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
AIRFLOW = Path(sys.executable).parent / "airflow"

DRIVER = """
import json, runpy, sys
mod = runpy.run_path(sys.argv[1])
dag = next(v for v in mod.values() if type(v).__name__ == "DAG")
dr = dag.test(run_conf=json.loads(sys.argv[2]) or None)
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
with create_session() as s:
    tis = {ti.task_id: [str(ti.state), ti.try_number] for ti in dr.get_task_instances(session=s)}
    rows = s.scalars(XComModel.get_many(run_id=dr.run_id, dag_ids=dag.dag_id, key="return_value"))
    xcoms = {x.task_id: XComModel.deserialize_value(x) for x in rows}
result = {"state": str(dr.state), "run_id": dr.run_id, "tis": tis, "xcoms": xcoms}
print("RESULT " + json.dumps(result, default=str))
"""


def airflow_env(home: Path, dags: Path, berth_home: Path, **env: str | None) -> dict[str, str]:
    """This process's environment for a DAG run: Airflow in `home` (SQLite, migrated here),
    DAGs from `dags`, Berth in `berth_home`, this repository importable; then `env` (a None
    value removes the variable)."""
    home.mkdir(parents=True, exist_ok=True)
    out = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "BERTH_HOME": str(berth_home),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for key, value in env.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    done = subprocess.run(
        [str(AIRFLOW), "db", "migrate"], env=out, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def run_dag(
    env: dict[str, str], dag_file: Path, conf: dict | None = None, timeout_s: float = 300
) -> tuple[dict[str, Any], str]:
    """Run the DAG of `dag_file` with dag.test() in a fresh process; its result and output."""
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(dag_file), json.dumps(conf or {})],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    out = done.stdout + done.stderr
    assert "RESULT " in out, out[-5000:]
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0]), out
