"""MLflow's system metrics of a gang's replicas, end to end: a real MLflow server, a real gang of
two replicas through the local runtime, each with the environment the platform gives it (the
tracker's MLFLOW_* variables, the runtime's per-rank MLFLOW_SYSTEM_METRICS_NODE_ID), and the
sampling interval lowered by the platform's BERTH_SYSTEM_METRICS_INTERVAL_S instead of MLflow's
10 s, so that samples arrive within a second or two. Read back through the MLflow API.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import cluster
from mlflow.tracking import MlflowClient
from mlflow_server import MlflowServer
from waiting import wait_for

from berth.runtime import LocalRuntime
from berth.settings import BerthSettings
from berth.tracking import AttemptRun, JobTracker
from scheduling.jobs import Placement, ReplicaPlacement

DEADLINE_S = 90.0  # generous: the machine is shared; samples come every 0.5 s
INTERVAL_S = "0.5"
MLFLOW_DEFAULT_INTERVAL_MS = 10_000
# Two ranks on one node: their node ids must still differ (the runtime adds the rank).
SAME_NODE = Placement((ReplicaPlacement(0, (0,)), ReplicaPlacement(0, (1,))), "node")

# Plain training-code MLflow: resume the platform's run, work until told to stop. MLflow's sampler
# runs while the run is active; it stops when any rank ends the (shared) run, so the gang runs
# until the test has seen every rank's samples, then ends together.
REPLICA = textwrap.dedent(
    """
    import os, sys, time
    import mlflow

    stop = sys.argv[1]
    print("node", os.environ["MLFLOW_SYSTEM_METRICS_NODE_ID"],
          "interval", os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"), flush=True)
    with mlflow.start_run():  # resumes MLFLOW_RUN_ID and starts the system-metrics sampler
        deadline = time.monotonic() + 120
        while not os.path.exists(stop):
            if time.monotonic() > deadline:
                sys.exit("the test never said stop")
            time.sleep(0.05)
    """
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


def nvml_works() -> bool:
    """Whether MLflow's GPU monitor can see a GPU here (it needs nvidia-ml-py and a driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    return True


def test_each_rank_logs_system_metrics_under_its_own_node_id(
    server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SAMPLING_INTERVAL", "SAMPLES_BEFORE_LOGGING", "NODE_ID"):
        monkeypatch.delenv(f"MLFLOW_SYSTEM_METRICS_{name}", raising=False)  # the platform's only
    s = BerthSettings.from_env(
        {
            "BERTH_HOME": str(tmp_path / "home"),
            "MLFLOW_TRACKING_URI": server.uri,
            "BERTH_SYSTEM_METRICS_INTERVAL_S": INTERVAL_S,
        }
    )
    tracker = s.tracker()
    assert tracker is not None
    run = tracker.open_attempt(
        job_id="gang-1",
        job_name="gang",
        experiment="berth-system-metrics",
        attempt=1,
        params={"replicas": 2},
        tags={},
    )
    rt = LocalRuntime(tmp_path / "runtime", grace_s=2.0)
    stop = tmp_path / "stop"
    launch = rt.launch(
        "gang-1",
        1,
        [sys.executable, "-c", REPLICA, str(stop)],
        SAME_NODE,
        cluster(nodes=1, gpus=4, groups=1),
        env={},
        workdir=tmp_path / "work",
        extra_env=tracker.attempt_env(run),
    )
    nodes = ["n-000-rank0", "n-000-rank1"]
    client = MlflowClient(server.uri)
    cpu = {node: f"system/{node}/cpu_utilization_percentage" for node in nodes}

    def two_samples_per_rank() -> dict[str, list] | None:
        gang = rt.poll(launch)
        if gang.state != "running":
            pytest.fail(f"the gang ended before its samples: {gang.state} {gang.message}")
        history = {n: client.get_metric_history(run.run_id, key) for n, key in cpu.items()}
        return history if all(len(h) >= 2 for h in history.values()) else None

    try:
        history = wait_for(
            two_samples_per_rank, "two system-metrics samples of every rank", DEADLINE_S, 0.2
        )
    finally:
        stop.touch()
        ended = wait_for(
            lambda: (g := rt.poll(launch)).state != "running" and g, "the gang", DEADLINE_S
        )
    assert ended.state == "succeeded", ended.message
    lines, _ = rt.logs(launch)
    for rank, node in enumerate(nodes):
        assert f"[rank {rank}] node {node} interval {INTERVAL_S}" in lines

    metrics = client.get_run(run.run_id).data.metrics
    for node in nodes:
        # Samples come at the platform's interval, not MLflow's default of 10 s.
        first, second = sorted(history[node], key=lambda m: m.timestamp)[:2]
        assert second.timestamp - first.timestamp < MLFLOW_DEFAULT_INTERVAL_MS / 2
        assert 0 <= metrics[cpu[node]] <= 100
        assert metrics[f"system/{node}/system_memory_usage_megabytes"] > 0
        assert 0 < metrics[f"system/{node}/system_memory_usage_percentage"] <= 100
    # Every sample is filed under a rank's node id: none under a bare system/ name.
    assert {key.split("/")[1] for key in metrics if key.startswith("system/")} == set(nodes)
    gpu = sorted(key for key in metrics if key.startswith("system/") and "/gpu_" in key)
    if nvml_works():  # a GPU that MLflow can read: every rank reports it
        assert all(any(k.startswith(f"system/{n}/gpu_") for k in gpu) for n in nodes), gpu
    else:  # none here: no GPU metrics rather than made-up ones
        assert gpu == []


def test_the_sampling_interval_reaches_the_replicas_only_when_set(tmp_path: Path) -> None:
    run = AttemptRun("1", "parent", "run", 1)
    default = JobTracker("http://127.0.0.1:9", tmp_path).attempt_env(run)  # no server needed
    assert default["MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"] == "true"
    assert "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL" not in default  # MLflow's default, 10 s
    s = BerthSettings.from_env(
        {
            "BERTH_HOME": str(tmp_path),
            "MLFLOW_TRACKING_URI": "http://127.0.0.1:9",
            "BERTH_SYSTEM_METRICS_INTERVAL_S": "2.5",
        }
    )
    tracker = s.tracker()
    assert tracker is not None
    assert tracker.attempt_env(run)["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] == "2.5"


@pytest.mark.parametrize("value", ["0", "-1", "fast", "nan", "inf"])
def test_a_bad_interval_names_the_variable_and_the_fix(value: str) -> None:
    with pytest.raises(
        ValueError, match=rf"BERTH_SYSTEM_METRICS_INTERVAL_S: .* got '{value}'; e\.g\. 10"
    ):
        BerthSettings.from_env({"BERTH_SYSTEM_METRICS_INTERVAL_S": value})
