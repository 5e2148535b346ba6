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
