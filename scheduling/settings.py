"""Where Berth's processes find their home, store, cluster and teams: environment variables.

Read when a task, trigger or command runs (never when a DAG file is parsed), so that an Airflow
worker, the triggerer, `dag.test()` in a test and the `berth` command all find the same store,
and nothing secret is written into a DAG or a trigger's serialized kwargs:

- `BERTH_HOME`: Berth's working folder (default `<repo>/.berth`, git-ignored): the SQLite
  store, virtualenvs, staged data, attempt working directories, collected artifacts, the
  tracking spool.
- `BERTH_STORE_URL`: the store (default `sqlite:///$BERTH_HOME/berth.db`; a
  `postgresql+psycopg://` URL in the cluster shape).
- `BERTH_CLUSTER`, `BERTH_TEAMS`: cluster and teams YAML (default `config/local-cluster.yaml`
  and `config/teams.yaml` in this repository).
- `BERTH_RUNTIME`: `local` (the embedded default) or `kubernetes` (pods in each team's
  namespace; the API server from `KUBECONFIG`, else the in-cluster service account).
- `MLFLOW_TRACKING_URI`: the MLflow server (unset: jobs are not tracked).
- `BERTH_AIRFLOW_URL`: the Airflow UI, for links back to a task (default
  `http://localhost:8080`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from scheduling.cluster import Cluster
from scheduling.config import load_cluster, load_teams
from scheduling.quota import Team

if TYPE_CHECKING:
    from scheduling.runtime import Runtime
    from scheduling.store import Store
    from scheduling.tracking import JobTracker

REPO_ROOT = Path(__file__).resolve().parent.parent
RUNTIMES = ("local", "kubernetes")


@dataclass(frozen=True)
class BerthSettings:
    """The resolved locations; `from_env()` builds one, the rest derive from `home`."""

    home: Path
    store_url: str
    cluster_path: Path
    teams_path: Path
    runtime_kind: str = "local"
    tracking_uri: str | None = None
    airflow_url: str = "http://localhost:8080"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BerthSettings:
        env = os.environ if environ is None else environ
        home = Path(env.get("BERTH_HOME") or REPO_ROOT / ".berth").expanduser().resolve()
        url = env.get("BERTH_STORE_URL") or f"sqlite:///{home / 'berth.db'}"
        cluster = Path(env.get("BERTH_CLUSTER") or REPO_ROOT / "config" / "local-cluster.yaml")
        teams = Path(env.get("BERTH_TEAMS") or REPO_ROOT / "config" / "teams.yaml")
        kind = env.get("BERTH_RUNTIME") or "local"
        if kind not in RUNTIMES:
            raise ValueError(
                f"BERTH_RUNTIME: must be one of {', '.join(RUNTIMES)}, got {kind!r}; unset it "
                "for the local runtime"
            )
        tracking = env.get("MLFLOW_TRACKING_URI") or None
        airflow = (env.get("BERTH_AIRFLOW_URL") or "http://localhost:8080").rstrip("/")
        return cls(home, url, cluster, teams, kind, tracking, airflow)

    # Folders under BERTH_HOME, one per kind of thing the lifecycle keeps.
    @property
    def envs_dir(self) -> Path:
        return self.home / "envs"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "artifacts"

    @property
    def spool_dir(self) -> Path:
        return self.home / "tracking-spool"

    def workdir(self, job_id: str, attempt: int) -> Path:
        """One working directory per attempt, so a retry never sees a failed try's leftovers."""
        return self.runs_dir / job_id / str(attempt)

    def cluster(self) -> Cluster:
        return _cluster(self.cluster_path)

    def teams(self) -> dict[str, Team]:
        return _teams(self.teams_path)

    def store(self) -> Store:
        """One Store (one connection pool) per process and settings."""
        return _store(self)

    def runtime(self) -> Runtime:
        return _runtime(self)

    def tracker(self) -> JobTracker | None:
        """The MLflow tracker, or None when MLFLOW_TRACKING_URI is unset."""
        return _tracker(self) if self.tracking_uri else None


def settings() -> BerthSettings:
    """The settings of this process's environment."""
    return BerthSettings.from_env()


@cache
def _cluster(path: Path) -> Cluster:
    return load_cluster(path)


@cache
def _teams(path: Path) -> dict[str, Team]:
    return load_teams(path)


@cache
def _store(s: BerthSettings) -> Store:
    from scheduling.store import Store  # SQLAlchemy loads only where a task needs the store

    if s.store_url.startswith("sqlite:///"):
        s.home.mkdir(parents=True, exist_ok=True)
    return Store(s.store_url, s.cluster(), s.teams())


@cache
def _runtime(s: BerthSettings) -> Runtime:
    if s.runtime_kind == "kubernetes":  # the kubernetes client loads only then
        from scheduling.runtime.kubernetes import KubernetesRuntime
        from scheduling.runtime.kubernetes.connect import api_client

        return KubernetesRuntime(api_client())
    from scheduling.runtime import LocalRuntime

    return LocalRuntime(s.runs_dir)


@cache
def _tracker(s: BerthSettings) -> JobTracker:
    from scheduling.tracking import JobTracker  # mlflow loads only where a job is tracked

    assert s.tracking_uri is not None
    return JobTracker(s.tracking_uri, s.spool_dir)
