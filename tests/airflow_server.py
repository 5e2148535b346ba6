"""A real Airflow 3 deployment for a test: the `airflow standalone` shape, one process each.

`airflow standalone` runs the api-server, scheduler, DAG processor and triggerer as children of
one process, so a test could not kill the triggerer alone. `AirflowDeployment` starts the same
four components (LocalExecutor, SQLite metadata database, the simple auth manager with a
passwords file), configured as scripts/airflow.sh configures them, but each as its own process
group: `kill("triggerer")` SIGKILLs one whole component (the supervisor and its runner) and
`start("triggerer")` brings up a fresh one, while the others keep running.

A component may also run as several named instances at once, each its own group and log, with
variables of its own if need be: `start("triggerer", instance="b", env={...})` runs a second
triggerer, `kill("triggerer#b")` kills that one alone, and `instance_of(pid)` says which
instance a process belongs to. An instance killed or stopped on purpose is no longer expected
alive (`assert_alive()` checks every other one).

Everything lives under one temp folder (AIRFLOW_HOME, the component logs); `stop()` ends every
group it started, also after a failed test (use it in a fixture's finalizer), and the logs'
tails go into assertion messages so a failure says what the components saw.

`AirflowAPI` is the REST API with a JWT from the simple auth manager (`POST /auth/token`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from ports import free_port
from waiting import wait_for

REPO = Path(__file__).resolve().parent.parent
AIRFLOW = Path(sys.executable).parent / "airflow"
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
# What /api/v2/monitor/health calls each component.
HEALTH_KEYS = {"scheduler": "scheduler", "dag-processor": "dag_processor", "triggerer": "triggerer"}
USER = "admin"
INSTANCE = re.compile(r"[A-Za-z0-9_-]+")  # part of a log file's name


class AirflowAPI:
    """Airflow's REST API (`/api/v2`), logged in as the admin user."""

    def __init__(self, url: str, password: str) -> None:
        self.url = url
        self.http = httpx.Client()
        r = self.http.post(
            f"{url}/auth/token", json={"username": USER, "password": password}, timeout=30
        )
        r.raise_for_status()
        self.http.headers["Authorization"] = f"Bearer {r.json()['access_token']}"

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, f"{self.url}/api/v2{path}", timeout=60, **kw)
        if r.status_code >= 400:
            raise AssertionError(f"{method} /api/v2{path}: {r.status_code} {r.text[:1000]}")
        return r.json()

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None) -> str:
        """A new run of `dag_id` (now, with `conf`); its run id.

        Tried again (twice at most) when Airflow answers 500 "Database error": on SQLite, its
        single writer, a busy scheduler can hold the lock past the API server's 5 s busy
        timeout, and the request's first write (its audit log row, before the run is made)
        fails; nothing was created, so a new try is safe (seen once in CI, on 2 busy cores)."""
        body = {"logical_date": None, "conf": dict(conf or {})}
        path = f"/dags/{dag_id}/dagRuns"
        for _ in range(2):
            r = self.http.post(f"{self.url}/api/v2{path}", json=body, timeout=60)
            if not (r.status_code == 500 and "Database error" in r.text):
                break
            time.sleep(2.0)
        else:  # a third and last try, its answer as it comes
            return str(self.call("POST", path, json=body)["dag_run_id"])
        if r.status_code >= 400:
            raise AssertionError(f"POST /api/v2{path}: {r.status_code} {r.text[:1000]}")
        return str(r.json()["dag_run_id"])

    def run_state(self, dag_id: str, run_id: str) -> str:
        return str(self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"])

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        got = self.call(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 1000}
        )
        return list(got["task_instances"])

    def pools(self) -> list[dict[str, Any]]:
        return list(self.call("GET", "/pools", params={"limit": 1000})["pools"])

    def dag_known(self, dag_id: str) -> bool:
        r = self.http.get(f"{self.url}/api/v2/dags/{dag_id}", timeout=60)
        return r.status_code == 200 and not r.json().get("has_import_errors", False)

    def import_errors(self) -> list[dict[str, Any]]:
        return list(self.call("GET", "/importErrors")["import_errors"])


class AirflowDeployment:
    """The four components on `root`, a DAG folder and a Berth home; see the module docstring.

    :param dags: the DAG folder the DAG processor parses (write the test DAGs there first: the
        folder is listed at start).
    :param berth_home: BERTH_HOME for tasks and triggers (store, runs, artifacts).
    :param extra_env: more variables for every component (e.g. Airflow options).
    """

    def __init__(
        self,
        root: Path,
        dags: Path,
        berth_home: Path,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.home = self.root / "airflow-home"
        self.logs = self.root / "component-logs"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(12)
        # By instance name ("triggerer", "triggerer#b"): those expected alive.
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[subprocess.Popen[bytes]] = []  # every group ever started, to stop
        self._generation: dict[str, int] = {}
        self._api: AirflowAPI | None = None
        plugins = REPO / "plugins"  # the repo's, as scripts/airflow.sh points Airflow at them
        passwords = self.home / "simple_auth_manager_passwords.json"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "BERTH"))}
        self.env.pop("MLFLOW_TRACKING_URI", None)  # jobs untracked: keeps the deployment light
        self.env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                "BERTH_HOME": str(berth_home),
                # Tasks, triggers and DAG files import our packages from here.
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
                ),
                "PATH": f"{AIRFLOW.parent}{os.pathsep}{os.environ.get('PATH', '')}",
                "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
                "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home / 'airflow.db'}",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
                # Components started apart must sign and check tokens with the same secrets.
                "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(16),
                "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
                "AIRFLOW__CORE__AUTH_MANAGER": (
                    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
                ),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
                **dict(extra_env or {}),
            }
        )
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        passwords.write_text(json.dumps({USER: self.password}))
        passwords.chmod(0o600)

    # -- lifecycle -------------------------------------------------------------------------

    def migrate(self, timeout_s: float = 600) -> None:
        """Create the metadata database (`airflow db migrate`), once, before any component."""
        done = subprocess.run(
            [str(AIRFLOW), "db", "migrate"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, f"airflow db migrate failed:\n{done.stderr[-3000:]}"

    def start(
        self,
        component: str,
        instance: str | None = None,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """Start one component in its own process group; its log goes to
        `logs/<name>-<n>.log` (n counts the starts of that name).

        :param instance: names one of several instances of the component running at once
            (`"b"`: the instance `triggerer#b`); without it, the component's unnamed one.
        :param env: more variables for this instance alone (on top of the deployment's).
        :param args: more arguments for its command (`["--queues", "berth"]`)."""
        if component not in COMPONENTS:
            raise ValueError(f"component: one of {', '.join(COMPONENTS)}, got {component!r}")
        if instance is not None and not INSTANCE.fullmatch(instance):
            raise ValueError(f"instance: letters, digits, '_' or '-', got {instance!r}")
        name = component if instance is None else f"{component}#{instance}"
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            raise RuntimeError(f"{name} is already running (pid {running.pid})")
        n = self._generation[name] = self._generation.get(name, 0) + 1
        argv = [str(AIRFLOW), component, *args]
        if component == "api-server":
            argv += ["--port", str(self.port)]
        with open(self.logs / f"{name}-{n}.log", "wb") as log:
            proc = subprocess.Popen(
                argv,
                env=self.env | dict(env or {}),
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its workers and runners in one group, ended together
            )
        self.procs[name] = proc
        self.started.append(proc)
        return proc

    def start_all(self, timeout_s: float = 300) -> None:
        """Migrate, start the four components, and wait until the API says all are healthy."""
        self.migrate(timeout_s)
        for component in COMPONENTS:
            self.start(component)
        self.wait_healthy(COMPONENTS, timeout_s)

    def kill(self, name: str, timeout_s: float = 60) -> None:
        """SIGKILL the instance's whole process group (a crash: no cleanup, no goodbye) and
        wait until none of its processes is left. `name`: a component ("triggerer") or one of
        its named instances ("triggerer#b")."""
        proc = self.procs.pop(name)  # dead on purpose: no longer expected alive
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)
        wait_for(lambda: not _group_alive(proc.pid), f"{name}'s processes gone", timeout_s, 0.2)

    def stop(self, name: str | None = None) -> None:
        """End every process group this deployment started, or instance `name`'s alone (a
        clean shutdown, unlike `kill`): SIGTERM, then SIGKILL after 30 s."""
        procs = self.started if name is None else [self.procs.pop(name)]
        for proc in procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in procs:
            if _group_alive(proc.pid) or proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)

    # -- what the deployment says ----------------------------------------------------------

    @property
    def api(self) -> AirflowAPI:
        if self._api is None:
            self._api = AirflowAPI(self.url, self.password)
        return self._api

    def health(self) -> dict[str, Any] | None:
        try:
            r = httpx.get(f"{self.url}/api/v2/monitor/health", timeout=10)
        except httpx.HTTPError:
            return None
        return r.json() if r.is_success else None

    def wait_healthy(self, components: tuple[str, ...], timeout_s: float = 300) -> None:
        """Until `/api/v2/monitor/health` reports each of `components` (instance names) healthy;
        fails at once, with its log, if one of them exits. The API reports a component's most
        recent heartbeat, not each instance's: one healthy triggerer makes them all healthy."""

        def check() -> bool:
            self.assert_alive(components)
            health = self.health()
            if health is None:
                return False
            kinds = {c.partition("#")[0] for c in components}
            keys = [HEALTH_KEYS[c] for c in kinds if c in HEALTH_KEYS]
            return all((health.get(k) or {}).get("status") == "healthy" for k in keys)

        what = f"Airflow components {components} healthy"
        wait_for(check, what, timeout_s, every=1.0, detail=self.log_tails)

    def assert_alive(self, components: tuple[str, ...] | None = None) -> None:
        """Fail, with the logs, if one of `components` (instance names; by default every
        instance started and not killed or stopped since) is not running."""
        for c in tuple(self.procs) if components is None else components:
            proc = self.procs.get(c)
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise AssertionError(
                    f"Airflow {c} is not running (exit {code})\n{self.log_tails()}"
                )

    def instance_of(self, pid: int) -> str | None:
        """The running instance whose process group holds process `pid` (its supervisor, or a
        process that one forked), or None."""
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return None
        return next((n for n, p in self.procs.items() if p.pid == pgid and p.poll() is None), None)

    def log_tails(self, chars: int = 2500) -> str:
        """The end of every component's log, for an assertion message."""
        out = []
        for path in sorted(self.logs.glob("*.log")):
            text = path.read_text(errors="replace")
            out.append(f"--- {path.name} ---\n{text[-chars:]}")
        return "\n".join(out)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
