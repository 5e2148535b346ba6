"""MLflow as docker/README.md deploys it (step 4), run for real: MLflow 3 answers 403 to a
Host header it does not list, while `/health` stays green, so a server without the right
`--allowed-hosts` would leave every job silently untracked. The walkthrough's arguments and
readiness probe are read from the page and tried against a real server."""

from __future__ import annotations

import http.client
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from mlflow_server import MlflowServer
from test_kube_manifests import readme_yaml_blocks

REPO = Path(__file__).resolve().parents[1]
README = REPO / "docker" / "README.md"
VALUES = REPO / "docker" / "helm" / "values.yaml"


def walkthrough_objects() -> list[dict[str, Any]]:
    return [
        doc
        for block in readme_yaml_blocks(README.read_text())
        for doc in yaml.safe_load_all(block)
        if isinstance(doc, dict) and "kind" in doc
    ]


def mlflow_container() -> dict[str, Any]:
    [deployment] = [
        d
        for d in walkthrough_objects()
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow"
    ]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def values_env() -> dict[str, str]:
    values = yaml.safe_load(VALUES.read_text())
    return {e["name"]: e["value"] for e in values["env"]}


def status(server: MlflowServer, path: str, host: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", path, headers={"Host": host})
        return conn.getresponse().status
    finally:
        conn.close()


def probe() -> tuple[str, str]:
    get = mlflow_container()["readinessProbe"]["httpGet"]
    [host] = [h["value"] for h in get["httpHeaders"] if h["name"] == "Host"]
    return get["path"], host


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    args = [a for a in mlflow_container()["args"] if a.startswith("--allowed-hosts=")]
    assert args, "the walkthrough's MLflow has no --allowed-hosts"
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-deployed"), extra_args=args)
    server.start()
    yield server
    server.stop()


def test_the_deployed_server_answers_the_names_clients_use_and_refuses_others(
    deployed: MlflowServer,
) -> None:
    path, probe_host = probe()
    env = values_env()
    inside = urlsplit(env["MLFLOW_TRACKING_URI"]).netloc  # what every task sends
    public = urlsplit(env["BERTH_MLFLOW_PUBLIC_URL"]).netloc  # what browsers send
    [ingress] = [d for d in walkthrough_objects() if d["kind"] == "Ingress"]
    served = {r["host"] for r in ingress["spec"]["rules"]}
    assert public in served and urlsplit(env["BERTH_AIRFLOW_URL"]).netloc in served
    for host in (probe_host, inside, public, "mlflow:5000"):
        assert status(deployed, path, host) == 200, host
    assert status(deployed, path, "attacker.example.net") == 403  # a list, not everyone
    assert status(deployed, path, f"{public}:8443") == 403  # the port is part of the match


def test_without_the_allow_list_the_probe_fails_where_health_would_not(tmp_path: Path) -> None:
    path, probe_host = probe()
    bare = MlflowServer(tmp_path)  # MLflow's defaults: localhost and private IPs
    bare.start()
    try:
        assert status(bare, "/health", probe_host) == 200  # why /health is not the probe
        assert status(bare, path, probe_host) == 403
    finally:
        bare.stop()
