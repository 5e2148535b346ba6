"""`berth jobs | job | usage | cancel` read and change the store the operators use."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from berth.cli import app
from berth.settings import REPO_ROOT, settings
from berth.spec import parse_spec


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("BERTH_HOME", str(tmp_path))
    monkeypatch.setenv("BERTH_CLUSTER", str(REPO_ROOT / "config" / "local-cluster.yaml"))
    monkeypatch.setenv("BERTH_TEAMS", str(REPO_ROOT / "config" / "teams.yaml"))
    return settings().store()


def _spec(name: str, team: str, replicas: int, gpus: float):
    return parse_spec(
        {
            "name": name,
            "team": team,
            "command": ["python", "train.py"],
            "replicas": replicas,
            "gpus_per_replica": gpus,
            "environment": {"requirements": []},
        }
    )


def _run(*args: str) -> str:
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.output


def test_on_call_sees_where_a_job_runs_and_why_another_waits(store):
    store.submit(_spec("big", "research", 2, 1.0), job_id="big-1", now=100.0)
    store.submit(_spec("more", "research", 1, 1.0), job_id="more-1", now=101.0)
    store.schedule(now=102.0)
    assert store.status("big-1").state == "admitted"
    out = _run("jobs")
    assert "big-1" in out and "admitted" in out and "local-" in out
    assert "more-1" in out and "quota (#1)" in out
    detail = _run("job", "more-1")
    assert "waiting: quota" in detail and "position 1 in team research's queue" in detail
    assert "submit" in detail  # the history table
    usage = _run("usage")
    assert "research" in usage and "vision" in usage
    row = next(line for line in usage.splitlines() if "research" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[:5] == ["research", "2", "2", "2", "0"]  # held, nominal, ceiling, borrowed


def test_cancel_frees_the_gpus_and_unknown_ids_are_named(store):
    store.submit(_spec("big", "vision", 2, 2.0), job_id="big-2", now=100.0)
    store.schedule(now=101.0)
    assert "cancelled" in _run("cancel", "big-2")
    assert store.usage()["vision"].gpus == 0
    res = CliRunner().invoke(app, ["job", "nope"])
    assert res.exit_code == 2 and "no job 'nope'" in res.output


def test_usage_shows_each_teams_gpus_per_model_against_its_model_keys(tmp_path, monkeypatch):
    """On a cluster of two models, with a key for H100s: every team's row for the governed
    model (a team without a key has a nominal of 0 of it), and the other model where held."""
    (tmp_path / "cluster.yaml").write_text(
        "name: two\nnodes:\n"
        "  - {name: h0, gpus: 4, gpu_model: H100, cpus: 8, memory_gb: 32}\n"
        "  - {name: a0, gpus: 4, gpu_model: A100, cpus: 8, memory_gb: 32}\n"
    )
    (tmp_path / "teams.yaml").write_text(
        "teams:\n"
        "  - {name: research, nominal: {gpus: 4, gpus.H100: 2}, borrowing_limit: {gpus.H100: 1}}\n"
        "  - {name: vision, nominal: {gpus: 4}}\n"
    )
    monkeypatch.setenv("BERTH_HOME", str(tmp_path))
    monkeypatch.setenv("BERTH_CLUSTER", str(tmp_path / "cluster.yaml"))
    monkeypatch.setenv("BERTH_TEAMS", str(tmp_path / "teams.yaml"))
    store = settings().store()
    h100 = parse_spec(_spec("h", "research", 2, 1.0).model_dump() | {"gpu_model": "H100"})
    a100 = parse_spec(_spec("a", "vision", 1, 2.0).model_dump() | {"gpu_model": "A100"})
    store.submit(h100, job_id="h-1", now=100.0)
    store.submit(a100, job_id="a-1", now=100.0)
    store.schedule(now=101.0)
    rows = {(u.team, m.model): m for u in store.usage().values() for m in u.models}
    assert set(rows) == {("research", "H100"), ("vision", "H100"), ("vision", "A100")}
    assert (rows["research", "H100"].gpus, rows["research", "H100"].nominal) == (2, 2)
    assert rows["research", "H100"].ceiling == 3
    assert (rows["vision", "H100"].gpus, rows["vision", "H100"].nominal) == (0, 0)
    assert rows["vision", "A100"].gpus == 2 and rows["vision", "A100"].nominal is None
    out = _run("usage")
    assert "GPU usage by team and model" in out
    line = next(ln for ln in out.splitlines() if "vision" in ln and "A100" in ln)
    assert [c.strip() for c in line.split("│") if c.strip()] == ["vision", "A100", "2", "-", "-"]


def test_usage_shows_the_organization_tree(tmp_path, monkeypatch):
    """research and vision in the ml department (which lends at most 2 of its 6 GPUs), infra
    at the root: each team's cohort, and each cohort's GPUs held against its quota."""
    (tmp_path / "teams.yaml").write_text(
        "cohorts:\n  - {name: ml, lending_limit: {gpus: 2}}\n"
        "teams:\n"
        "  - {name: research, cohort: ml, nominal: {gpus: 4}}\n"
        "  - {name: vision, cohort: ml, nominal: {gpus: 2}}\n"
        "  - {name: infra, nominal: {gpus: 2}}\n"
    )
    monkeypatch.setenv("BERTH_HOME", str(tmp_path))
    monkeypatch.setenv("BERTH_CLUSTER", str(REPO_ROOT / "config" / "local-cluster.yaml"))
    monkeypatch.setenv("BERTH_TEAMS", str(tmp_path / "teams.yaml"))
    store = settings().store()
    store.submit(_spec("r", "research", 1, 3.0), job_id="r-1", now=100.0)
    store.submit(_spec("v", "vision", 1, 1.0), job_id="v-1", now=100.0)
    store.schedule(now=101.0)
    usage = store.usage()
    assert usage["research"].cohorts == ("ml",) and usage["infra"].cohorts == ()
    out = _run("usage")
    team_row = next(ln for ln in out.splitlines() if "research" in ln and "│" in ln)
    assert [c.strip() for c in team_row.split("│") if c.strip()][:3] == ["research", "ml", "3"]
    assert "GPU usage by cohort (organization tree)" in out
    row = next(ln for ln in out.splitlines() if ln.strip("│ ").startswith("ml"))
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells == ["ml", "-", "research, vision", "4", "6", "4", "inf"]  # no borrowing limit
