"""What the plugin's API tests share: a real SQLite store driven through a small history with
explicit times (two jobs borrow, one is preempted to give a team its nominal back, a shared GPU,
jobs never looked at, one finished), and the plugin's app mounted at `/berth` in a bare FastAPI
app as Airflow's API server mounts it, with Airflow's login swapped for a user who may do
anything (`mounted(store, login=True)` keeps it); `scrape` parses its metrics. Used by
test_plugin_api.py and test_plugin_metrics.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from airflow.api_fastapi.core_api.security import get_user
from builders import cluster, job_spec, teams
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from berth.store import Store
from plugins.berth_api import access, source
from plugins.berth_api.app import create_app
from scheduling.policy import BERTH

REPO = Path(__file__).resolve().parent.parent
CLUSTER = cluster(nodes=2, gpus=4, groups=2)  # 2 nodes x 4 GPUs, 2 NVLink pairs each
TEAMS = teams(a={"nominal": 4, "borrowing_limit": 4}, b=4)  # b's borrowing is unlimited
FAST = replace(BERTH, name="berth-fast", min_runtime_s=0.0, preemption_delay_s=0.0)
API = "/berth/api/v1"


@dataclass
class History:
    victim: str  # a's job preempted to give b its nominal back; queued again
    survivor: str  # a's other job, running


def borrow(store: Store) -> None:
    """t=0..2: team a takes all 8 GPUs, 4 of them borrowed from b's idle nominal."""
    store.submit(job_spec("a1", "a", 4), job_id="a1", now=0.0)
    store.submit(job_spec("a2", "a", 4), job_id="a2", now=0.5)
    store.schedule(now=1.0)
    store.mark_started("a1", 1, now=2.0)
    store.mark_started("a2", 1, now=2.0)


def reclaim(store: Store) -> History:
    """t=10..11: b asks for 2 GPUs of its nominal; one of a's jobs is preempted (stopping)."""
    store.submit(job_spec("b1", "b", 2), job_id="b1", now=10.0)
    report = store.schedule(now=11.0)
    assert report.admitted == ("b1",) and len(report.preempted) == 1, report
    victim = report.preempted[0]
    return History(victim=victim, survivor=({"a1", "a2"} - {victim}).pop())


def settle(store: Store, h: History) -> None:
    """t=12..21: the victim stops and waits again (its team has no quota left to borrow); two
    half-GPU jobs share a GPU, one of them ends; d and e were never looked at by a cycle."""
    store.finish(h.victim, "preempted", attempt=1, now=12.0)
    store.schedule(now=13.0)
    store.mark_started("b1", 1, now=13.5)
    store.submit(job_spec("c", "b", 0.5), job_id="c", now=13.0)
    store.submit(job_spec("f", "b", 0.5), job_id="f", now=13.0)
    store.schedule(now=16.0)
    store.mark_started("f", 1, now=16.5)
    store.finish("f", "succeeded", exit_code=0, attempt=1, now=18.0)
    store.submit(job_spec("d", "b", 1), job_id="d", now=20.0)
    store.submit(job_spec("e", "b", 1, priority=10), job_id="e", now=21.0)


@pytest.fixture(name="store")
def store_fixture(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path}/berth.db", CLUSTER, TEAMS, FAST)
    yield s
    s.close()


@pytest.fixture(name="history")
def history_fixture(store: Store) -> History:
    borrow(store)
    h = reclaim(store)
    settle(store, h)
    return h


class Anyone:
    """Stands in for Airflow's user: the auth manager itself is checked in the deployment."""

    def get_name(self) -> str:
        return "on-call"


def mounted(store: Store, *, login: bool = False) -> TestClient:
    app = create_app()
    app.dependency_overrides[source.current_store] = lambda: store
    if not login:
        app.dependency_overrides[get_user] = Anyone
        app.dependency_overrides[access.may_read] = lambda: None
        app.dependency_overrides[access.may_cancel] = lambda: None
    airflow = FastAPI()
    airflow.mount("/berth", app)  # as Airflow's API server mounts a plugin's app
    return TestClient(airflow)


@pytest.fixture(name="client")
def client_fixture(store: Store) -> TestClient:
    return mounted(store)


def get(client: TestClient, path: str, status: int = 200, **kw: Any) -> Any:
    r = client.get(path, **kw)
    assert r.status_code == status, r.text
    return r.json()


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, parsed by Prometheus' own parser."""
    r = client.get("/berth/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def by_name(samples: dict, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}
