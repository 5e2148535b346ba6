"""A private `airflow standalone` for benchmarks, set up as scripts/airflow.sh sets one up:
a free port, a temporary AIRFLOW_HOME and BERTH_HOME, the simple auth manager with a random
password, Berth's scheduling loop beside it, the team pools synced and `berth_job` unpaused.

Split from lifecycle_bench.py, which measures latencies through it: starting and stopping
Airflow is one job, the rounds and their samples another.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT

VENV_BIN = Path(sys.executable).parent
DAG = "berth_job"


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.25) -> Any:
    """Poll `check` until it returns something truthy, or fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)


class Standalone:
    """`airflow standalone` in its own process group, set up as scripts/airflow.sh does."""

    def __init__(
        self, root: Path, overrides: dict[str, str], dags: Path, loop: bool = True
    ) -> None:
        self.loop = loop
        self.loop_proc: subprocess.Popen[bytes] | None = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://localhost:{self.port}"
        self.password = secrets.token_urlsafe(12)
        home, self.berth_home = root / "airflow", root / "berth"
        home.mkdir(parents=True)
        passwords = home / "simple_auth_manager_passwords.json"
        passwords.write_text(json.dumps({"admin": self.password}))
        passwords.chmod(0o600)
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "BERTH"))}
        keep.pop("MLFLOW_TRACKING_URI", None)
        self.env = keep | {
            "BERTH_HOME": str(self.berth_home),
            "AIRFLOW_HOME": str(home),
            "PYTHONPATH": str(ROOT),
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple."
            "simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            **overrides,
        }
        self.log = root / "standalone.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client()

    def _spawn(self, program: str, command: str, log: Path) -> subprocess.Popen[bytes]:
        """`program command` with this Airflow's environment, its output in `log`, in a
        process group of its own (one group to stop, whatever it spawns)."""
        with open(log, "wb") as out:
            return subprocess.Popen(
                [str(VENV_BIN / program), command],
                env=self.env,
                cwd=self.berth_home.parent,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self, timeout_s: float) -> None:
        self.proc = self._spawn("airflow", "standalone", self.log)
        if self.loop:  # Berth's scheduling loop, as scripts/airflow.sh runs it
            self.loop_proc = self._spawn(
                "berth", "scheduler", self.berth_home.parent / "scheduler.log"
            )
        wait_for("Airflow's API and DAG berth_job", self._ready, timeout_s, every_s=1.0)
        subprocess.run(
            [
                str(VENV_BIN / "berth"),
                "pools",
                "sync",
                "--api-url",
                self.url,
                "--username",
                "admin",
                "--password",
                self.password,
            ],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        self.call("PATCH", f"/dags/{DAG}", json={"is_paused": False})

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"airflow standalone exited ({self.proc.returncode}):\n{tail}")
        try:
            if "Authorization" not in self.http.headers:
                r = self.http.post(
                    f"{self.url}/auth/token",
                    timeout=10,
                    json={"username": "admin", "password": self.password},
                )
                if not r.is_success:
                    return False
                self.http.headers["Authorization"] = f"Bearer {r.json()['access_token']}"
            health = self.http.get(f"{self.url}/api/v2/monitor/health", timeout=10).json()
            dag = self.http.get(f"{self.url}/api/v2/dags/{DAG}", timeout=10)
        except (httpx.HTTPError, ValueError):  # not up, or not answering JSON yet
            return False
        parts = ("scheduler", "triggerer", "dag_processor")
        healthy = all(health.get(k, {}).get("status") == "healthy" for k in parts)
        return healthy and dag.status_code == 200

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, f"{self.url}/api/v2{path}", timeout=60, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} /api/v2{path}: {r.status_code} {r.text[:500]}")
        return r.json()

    def stop(self) -> None:
        if self.loop_proc is not None and self.loop_proc.poll() is None:
            self.loop_proc.terminate()
            self.loop_proc.wait(timeout=30)
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
