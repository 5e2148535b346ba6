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
  and `config/teams.yaml` in this repository). With `BERTH_RUNTIME=kubernetes` the cluster is
  discovered from the nodes when `BERTH_CLUSTER` is unset or `discover`
  (berth/runtime/kubernetes/live.py), and what other workloads hold is taken off it.
- `BERTH_ACCESS`: who may use which team, an access.yaml of Airflow users per team
  (berth/access.py; unset: every user may use every team).
- `BERTH_POLICY_FILE`: the scheduling policy, a policy.yaml (scheduling/policy_file.py; the
  same file `berth simulate --policy-file` reads); unset: the `berth` policy.
- `BERTH_RUNTIME`: `local` (the embedded default) or `kubernetes` (pods in each team's
  namespace; the API server from the Airflow connection `BERTH_KUBE_CONN_ID` in Airflow's
  processes, else `KUBECONFIG`, else the in-cluster service account:
  berth/runtime/kubernetes/connect.py).
- `BERTH_TRIGGER_QUEUE`: the Airflow queue of Berth's tasks, and so of their triggers, read
  when a DAG file is parsed (operators/store_access.py); with `[triggerer] queues_enabled`
  only triggerers started with `--queues <it>` run Berth's triggers (unset: Airflow's default
  queue, as on the embedded default). Set, Berth's steps do their work in those triggerers and
  their tasks reach no store (operators/step_trigger.py, docs/decisions/0030). The Kubernetes
  and local executors ignore a task's queue otherwise; under Celery it would also route
  Berth's tasks to that queue's workers.
- `BERTH_KUBE_SETTINGS` (Kubernetes only): a YAML of how pods look (namespaces, tolerations,
  the data volume, DRA), which node labels give the topology and which nodes are Berth's
  (berth/runtime/kubernetes/config.py); unset: the defaults.
- `BERTH_BUILD_*` (Kubernetes only): where and how the images of jobs that give `environment`
  are built in the cluster (`BERTH_BUILD_REGISTRY`, `BERTH_BUILD_REPOSITORY`, the base image,
  Kaniko's image, the push Secret, `BERTH_BUILD_ALLOW_ROOT`, ...:
  berth/runtime/kubernetes/images.py `ENV`), read by `image_builder()`.
- `MLFLOW_TRACKING_URI`: the MLflow server (unset: jobs are not tracked).
- `BERTH_SYSTEM_METRICS_INTERVAL_S`: seconds between the replicas' MLflow system-metrics samples
  (passed to them as MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL; unset: MLflow's default, 10 s).
- `BERTH_ARTIFACTS_S3_PREFIX`: `s3://bucket/prefix`; every attempt's collected artifacts are
  also copied to `<prefix>/<job_id>/<attempt>/` (unset: they stay under BERTH_HOME). The
  endpoint: BERTH_S3_ENDPOINT_URL or MLFLOW_S3_ENDPOINT_URL, else boto3's own
  (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL); credentials: boto3's chain.
- `BERTH_POOL_SYNC_S`: how often (seconds, default 30) Airflow's API server looks for a
  changed teams or cluster file and syncs the team pools (plugins/berth_api/pool_sync.py);
  `0` leaves the pools to `berth pools sync`.
- `BERTH_AIRFLOW_URL`: the Airflow UI as a browser reaches it, for links back to a task
  (default `http://localhost:8080`; on a cluster its public address, behind the Ingress).
- `BERTH_JOB_IMAGE`: on Kubernetes, the image the trigger form offers (with the demo's
  training script, /opt/berth/examples/train_mlp.py, as its command): docker/job-base's image,
  e.g. `registry.example.com/berth/job-base:0.1.0` (unset: the form's image is empty).
- `BERTH_MLFLOW_PUBLIC_URL`: the MLflow UI as a browser reaches it, for the "MLflow run" link
  (default: MLFLOW_TRACKING_URI, which on a cluster is an in-cluster name no browser opens).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from berth.access import Access, load_access
from berth.spec_fields import image_ref
from scheduling.cluster import Cluster
from scheduling.config import load_cluster, load_teams
from scheduling.policy import BERTH, Policy
from scheduling.policy_file import load_policy
from scheduling.quota import Team

if TYPE_CHECKING:
    from berth.runtime import Runtime
    from berth.runtime.kubernetes.build import ImageBuilder
    from berth.runtime.kubernetes.config import KubeConfig
    from berth.store import Store
    from berth.tracking import JobTracker

REPO_ROOT = Path(__file__).resolve().parent.parent
# BERTH_LAUNCH_LEASE_S's default: long against a launch's longest pause (a renewal's round trip
# to a busy store), short against the reaper's lease (berth/store/launch_claim.py).
LAUNCH_LEASE_S = 60.0
RUNTIMES = ("local", "kubernetes")
# Where the artifacts' S3 copy goes, in the order that wins (the last two are boto3's own).
S3_ENDPOINT_VARS = (
    "BERTH_S3_ENDPOINT_URL",
    "MLFLOW_S3_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
)


@dataclass(frozen=True)
class BerthSettings:
    """The resolved locations; `from_env()` builds one, the rest derive from `home`."""

    home: Path
    store_url: str
    cluster_path: Path | None  # None: discovered (Kubernetes)
    teams_path: Path
    runtime_kind: str = "local"
    tracking_uri: str | None = None
    airflow_url: str = "http://localhost:8080"
    mlflow_public_url: str | None = None  # None: the tracking URI
    job_image: str | None = None  # the trigger form's image on Kubernetes
    system_metrics_interval_s: float | None = None
    artifacts_s3_prefix: str | None = None
    kube_settings_path: Path | None = None
    policy_path: Path | None = None
    access_path: Path | None = None  # who may use which team (berth/access.py)
    # A launcher's claim on an attempt lapses this long after it last renewed it, so a job
    # whose launcher died is launched again by another within about that long
    # (berth/store/launch_claim.py).
    launch_lease_s: float = LAUNCH_LEASE_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BerthSettings:
        env = os.environ if environ is None else environ
        home = Path(env.get("BERTH_HOME") or REPO_ROOT / ".berth").expanduser().resolve()
        url = env.get("BERTH_STORE_URL") or f"sqlite:///{home / 'berth.db'}"
        teams = Path(env.get("BERTH_TEAMS") or REPO_ROOT / "config" / "teams.yaml")
        kind = env.get("BERTH_RUNTIME") or "local"
        if kind not in RUNTIMES:
            raise ValueError(
                f"BERTH_RUNTIME: must be one of {', '.join(RUNTIMES)}, got {kind!r}; unset it "
                "for the local runtime"
            )
        cluster = _cluster_path(env.get("BERTH_CLUSTER") or None, kind)
        tracking = env.get("MLFLOW_TRACKING_URI") or None
        airflow = _browser_url(env, "BERTH_AIRFLOW_URL") or "http://localhost:8080"
        return cls(
            home,
            url,
            cluster,
            teams,
            kind,
            tracking,
            airflow,
            mlflow_public_url=_browser_url(env, "BERTH_MLFLOW_PUBLIC_URL"),
            job_image=_job_image(env),
            system_metrics_interval_s=_system_metrics_interval(env),
            artifacts_s3_prefix=_artifacts_s3_prefix(env),
            kube_settings_path=Path(env["BERTH_KUBE_SETTINGS"])
            if env.get("BERTH_KUBE_SETTINGS")
            else None,
            policy_path=Path(env["BERTH_POLICY_FILE"]) if env.get("BERTH_POLICY_FILE") else None,
            access_path=Path(env["BERTH_ACCESS"]) if env.get("BERTH_ACCESS") else None,
            launch_lease_s=_launch_lease(env),
        )

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
        """The declared cluster, or the store's as last discovered."""
        if self.cluster_path is None:
            return self.store().cluster
        return _cluster(self.cluster_path)

    def policy(self) -> Policy:
        """BERTH_POLICY_FILE, read once (ConfigError names the file, the field and the fix)."""
        return _policy(self.policy_path) if self.policy_path else BERTH

    def teams(self) -> dict[str, Team]:
        return _teams(self.teams_path)

    def access(self) -> Access | None:
        """BERTH_ACCESS, read once (AccessError names the file, the field and the fix); None
        without one: every user may use every team."""
        return _access(self.access_path, self.teams_path) if self.access_path else None

    def store(self) -> Store:
        """One Store (one connection pool) per process and settings."""
        return _store(self)

    def runtime(self) -> Runtime:
        return _runtime(self)

    def kube_config(self) -> KubeConfig:
        """BERTH_KUBE_SETTINGS, read once (ConfigError names the file and the field)."""
        return _kube_config(self.kube_settings_path)

    def image_builder(self) -> ImageBuilder:
        """The in-cluster builder of `environment` jobs' images (BERTH_RUNTIME=kubernetes), with
        the BERTH_BUILD_* variables read now (ImageSettingsError names a bad one): not cached,
        so that only the jobs that need a build depend on them."""
        if self.runtime_kind != "kubernetes":
            raise ValueError("image builds run on the Kubernetes runtime; set BERTH_RUNTIME")
        from berth.runtime.kubernetes import KubernetesRuntime
        from berth.runtime.kubernetes.build import ImageBuilder
        from berth.runtime.kubernetes.images import ImageBuildSettings

        runtime = self.runtime()
        assert isinstance(runtime, KubernetesRuntime)
        build = ImageBuildSettings.from_env()
        return ImageBuilder(runtime.core.api_client, build, runtime.settings)

    def tracker(self) -> JobTracker | None:
        """The MLflow tracker, or None when MLFLOW_TRACKING_URI is unset."""
        return _tracker(self) if self.tracking_uri else None

    @property
    def mlflow_ui_url(self) -> str | None:
        """Where a browser opens MLflow: BERTH_MLFLOW_PUBLIC_URL, else the tracking URI."""
        return self.mlflow_public_url or self.tracking_uri


def settings() -> BerthSettings:
    """The settings of this process's environment."""
    return BerthSettings.from_env()


def _launch_lease(env: Mapping[str, str]) -> float:
    seconds = _seconds(
        env,
        "BERTH_LAUNCH_LEASE_S",
        f"e.g. {LAUNCH_LEASE_S:g} (the default): longer than a launch's longest pause, short "
        "enough that a dead launcher's job is launched again soon",
    )
    return LAUNCH_LEASE_S if seconds is None else seconds


def _system_metrics_interval(env: Mapping[str, str]) -> float | None:
    return _seconds(
        env,
        "BERTH_SYSTEM_METRICS_INTERVAL_S",
        "e.g. 10 (each sample costs every replica about two requests to MLflow), or unset it "
        "for MLflow's default of 10 s",
    )


def _seconds(env: Mapping[str, str], name: str, hint: str) -> float | None:
    """The variable `name` as a number of seconds above 0; None when unset or empty."""
    text = env.get(name) or None
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name}: must be a number of seconds above 0, got {text!r}; {hint}")
    return seconds


def _job_image(env: Mapping[str, str]) -> str | None:
    image = env.get("BERTH_JOB_IMAGE") or None
    if image is None:
        return None
    try:
        return image_ref(image)
    except ValueError as e:
        raise ValueError(f"BERTH_JOB_IMAGE: {e}") from None


def _browser_url(env: Mapping[str, str], var: str) -> str | None:
    """An address users open (links Berth writes), checked: a typo would give dead links."""
    url = env.get(var) or None
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise ValueError(
            f"{var}: must be an http(s) URL that a browser opens, got {url!r}; e.g. "
            "'https://airflow.example.com' (the host of the Ingress)"
        )
    return url.rstrip("/")


def _artifacts_s3_prefix(env: Mapping[str, str]) -> str | None:
    """The prefix, checked with the endpoint the upload will use, so that a typo fails every
    task at once with the variable's name instead of each upload later."""
    prefix = env.get("BERTH_ARTIFACTS_S3_PREFIX") or None
    if prefix is None:
        return None
    from berth.staging.artifacts import parse_s3_prefix  # boto3 loads only when set

    parse_s3_prefix(prefix, field="BERTH_ARTIFACTS_S3_PREFIX")
    for var in S3_ENDPOINT_VARS:
        url = env.get(var)
        if url and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc):
            raise ValueError(
                f"{var}: must be an http(s) URL of the S3 endpoint, got {url!r}; e.g. "
                "'http://minio.internal:9000', or unset it for AWS S3"
            )
    return prefix


def _cluster_path(given: str | None, kind: str) -> Path | None:
    if given == "discover" or (given is None and kind == "kubernetes"):
        if kind != "kubernetes":
            raise ValueError(
                "BERTH_CLUSTER: 'discover' reads the nodes of a Kubernetes cluster; set "
                "BERTH_RUNTIME=kubernetes, or give a cluster YAML for the local runtime"
            )
        return None
    return Path(given or REPO_ROOT / "config" / "local-cluster.yaml")


@cache
def _kube_config(path: Path | None) -> KubeConfig:
    from berth.runtime.kubernetes.config import load_kube_config

    return load_kube_config(path)


@cache
def _cluster(path: Path) -> Cluster:
    return load_cluster(path)


@cache
def _teams(path: Path) -> dict[str, Team]:
    return load_teams(path)


@cache
def _access(path: Path, teams_path: Path) -> Access:
    return load_access(path, _teams(teams_path))


@cache
def _policy(path: Path) -> Policy:
    return load_policy(path)


@cache
def _store(s: BerthSettings) -> Store:
    from berth.store import Store  # SQLAlchemy loads only where a task needs the store

    if s.store_url.startswith("sqlite:///"):
        s.home.mkdir(parents=True, exist_ok=True)
    if s.cluster_path is None:  # discovered from the nodes, kept for a few seconds
        from berth.runtime.kubernetes.connect import api_client
        from berth.runtime.kubernetes.live import LiveCluster

        kube = s.kube_config()
        live = LiveCluster(
            api_client(),
            kube.topology,
            tolerations=kube.pods.tolerations,
            node_selector=kube.node_selector,
            ttl_s=kube.discovery_ttl_s,
        )
        return Store(s.store_url, None, s.teams(), s.policy(), live=live)
    return Store(s.store_url, s.cluster(), s.teams(), s.policy())


@cache
def _runtime(s: BerthSettings) -> Runtime:
    if s.runtime_kind == "kubernetes":  # the kubernetes client loads only then
        from berth.runtime.kubernetes import KubernetesRuntime
        from berth.runtime.kubernetes.connect import api_client
        from berth.runtime.kubernetes.watch import ClusterWatch

        api, kube = api_client(), s.kube_config()
        # One per process (this function is cached), started by the first trigger that waits
        # on a gang (`KubernetesRuntime.changed`): a worker's short task lists nothing.
        watch = ClusterWatch(api) if kube.watch else None
        return KubernetesRuntime(api, kube.pods, watch=watch, model_label=kube.topology.gpu_product)
    from berth.runtime import LocalRuntime

    return LocalRuntime(s.runs_dir)


@cache
def _tracker(s: BerthSettings) -> JobTracker:
    from berth.tracking import JobTracker  # mlflow loads only where a job is tracked

    assert s.tracking_uri is not None
    return JobTracker(
        s.tracking_uri, s.spool_dir, system_metrics_interval_s=s.system_metrics_interval_s
    )
