"""The Berth plugin in a real Airflow: it loads in Airflow's API server, a token opens the
API, no token or a viewer's token to cancel does not, and the API server keeps the team pools
in step with the teams file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from airflow_server import AirflowDeployment
from builders import job_spec
from plugin_api_kit import API, REPO
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

from berth.settings import BerthSettings

# -- the plugin in a real Airflow -------------------------------------------------------------


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AirflowDeployment, Path]]:
    """Airflow's API server alone (the plugin lives there), with the repo's plugins folder, an
    admin and a viewer; its Berth home holds the store the test writes to."""
    root = tmp_path_factory.mktemp("airflow")
    dags = root / "dags"
    dags.mkdir()
    home = root / "berth"
    access = root / "access.yaml"  # who may use which team: admin vision, viewer research
    access.write_text("teams:\n  vision: [admin]\n  research: [viewer]\n")
    teams = root / "teams.yaml"  # the repo's, in a file the pool test may change
    teams.write_text((REPO / "config" / "teams.yaml").read_text())
    af = AirflowDeployment(
        root,
        dags,
        home,
        extra_env={
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
            "BERTH_ACCESS": str(access),
            "BERTH_TEAMS": str(teams),
            "BERTH_POOL_SYNC_S": "0.5",
        },
    )
    try:
        af.migrate()
        af.start("api-server")
        af.wait_healthy(("api-server",))
        yield af, home
    finally:
        af.stop()


def token(af: AirflowDeployment, user: str) -> str:
    passwords = af.home / "simple_auth_manager_passwords.json"
    # The auth manager writes a password for the viewer when the API server starts.
    password = wait_for(
        lambda: json.loads(passwords.read_text()).get(user), f"{user}'s password", 60
    )
    r = httpx.post(
        f"{af.url}/auth/token", json={"username": user, "password": password}, timeout=30
    )
    r.raise_for_status()
    return str(r.json()["access_token"])


def test_the_plugin_loads_in_airflow_behind_its_login(
    airflow: tuple[AirflowDeployment, Path],
) -> None:
    af, home = airflow
    plugins = af.api.call("GET", "/plugins")["plugins"]
    berth = [p for p in plugins if p["name"] == "berth"]
    assert len(berth) == 1, plugins
    assert [(a["name"], a["url_prefix"]) for a in berth[0]["fastapi_apps"]] == [("Berth", "/berth")]
    assert af.api.call("GET", "/plugins/importErrors")["import_errors"] == []

    # The store the API server reads: the same settings, from the same BERTH_HOME.
    store = BerthSettings.from_env({"BERTH_HOME": str(home)}).store()
    store.submit(job_spec("from-dag", "vision", 1), job_id="from-dag", labels={"dag_id": "train"})
    queue = f"{af.url}{API}/queue"
    assert httpx.get(queue, timeout=30).status_code == 401
    bad = {"Authorization": "Bearer not-a-token"}
    assert httpx.get(queue, headers=bad, timeout=30).status_code == 403

    admin = {"Authorization": f"Bearer {token(af, 'admin')}"}
    viewer = {"Authorization": f"Bearer {token(af, 'viewer')}"}
    for who in (admin, viewer):
        r = httpx.get(queue, headers=who, timeout=30)
        assert r.status_code == 200, af.log_tails()
        assert [j["id"] for j in r.json()["jobs"]] == ["from-dag"]

    cancel = f"{af.url}{API}/jobs/from-dag/cancel"
    r = httpx.post(cancel, headers=viewer, timeout=30)
    assert r.status_code == 403 and "DAG 'train'" in r.json()["detail"]
    assert store.status("from-dag").state == "queued"
    r = httpx.post(cancel, headers=admin, timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
    assert store.status("from-dag").state == "cancelled"
    # Airflow lets the admin change every DAG's runs, but BERTH_ACCESS keeps research's jobs
    # to research's users.
    store.submit(job_spec("theirs", "research", 1), job_id="theirs", labels={"dag_id": "train"})
    r = httpx.post(f"{af.url}{API}/jobs/theirs/cancel", headers=admin, timeout=30)
    detail = r.json()["detail"]
    assert r.status_code == 403 and "user 'admin' may not cancel jobs of team 'research'" in detail
    assert "your teams: vision" in detail and "teams.research" in detail, detail
    assert store.status("theirs").state == "queued"

    metrics = httpx.get(f"{af.url}/berth/metrics", timeout=30)
    assert metrics.status_code == 200
    names = {f.name for f in text_string_to_metric_families(metrics.text)}
    assert {"berth_pending_jobs", "berth_finished_jobs", "berth_cluster_gpus"} <= names
    assert 'berth_finished_jobs_total{outcome="cancelled",team="vision"} 1.0' in metrics.text


def test_the_api_server_keeps_the_team_pools_in_step_with_the_teams_file(
    airflow: tuple[AirflowDeployment, Path],
) -> None:
    """No `berth pools sync` by hand: the API server creates a pool per team (slots: the GPUs
    the team may reach, deferred tasks not counted) and updates it when the file changes."""
    af, _ = airflow
    teams_file = Path(af.env["BERTH_TEAMS"])
    before = teams_file.read_text()

    def team_pools() -> dict[str, tuple[int, bool]]:
        pools = af.api.call("GET", "/pools")["pools"]
        return {p["name"]: (p["slots"], p["include_deferred"]) for p in pools
                if p["name"].startswith("berth-")}  # fmt: skip

    wanted = {"berth-vision": (8, False), "berth-language": (4, False)}
    wanted["berth-research"] = (2, False)
    wait_for(lambda: team_pools() == wanted, f"the team pools {wanted}", 60)
    try:
        more = before.replace("borrowing_limit: {gpus: 0}", "borrowing_limit: {gpus: 3}")
        assert more != before
        teams_file.write_text(more)
        wanted["berth-research"] = (5, False)
        wait_for(lambda: team_pools() == wanted, "berth-research resized to 5 slots", 60)
    finally:
        teams_file.write_text(before)
    wanted["berth-research"] = (2, False)
    wait_for(lambda: team_pools() == wanted, "berth-research back to 2 slots", 60)
