"""The plugin's Prometheus metrics (`/berth/metrics`) against a real store: parsed by
Prometheus' own parser, matched to the store, read anew on every scrape, and the Grafana
dashboard's queries named among them (the store's history: tests/plugin_api_kit.py)."""

from __future__ import annotations

import json
import re

from fastapi.testclient import TestClient
from plugin_api_kit import (  # noqa: F401 (fixtures)
    API,
    REPO,
    History,
    by_name,
    client_fixture,
    history_fixture,
    scrape,
    store_fixture,
)
from sqlalchemy import select

from berth.store import Store
from berth.store.schema import engine_row
from berth.store.views import ModelUsage, TeamUsage


def test_metrics_parse_and_match_the_store(
    store: Store, history: History, client: TestClient
) -> None:
    m = scrape(client)
    # Pending, counted from the jobs themselves, not from the same aggregate query.
    pending: dict[tuple[tuple[str, str], ...], float] = {}
    for s in store.jobs(states=["queued"]):
        key = (("reason", s.reason_code or "unexamined"), ("team", s.team))
        pending[key] = pending.get(key, 0) + 1
    assert (
        by_name(m, "berth_pending_jobs")
        == pending
        == {
            (("reason", "quota"), ("team", "a")): 1,
            (("reason", "unexamined"), ("team", "b")): 2,
        }
    )
    usage = store.usage()
    for team, u in usage.items():
        key = (("resource", "gpus"), ("team", team))
        assert m["berth_team_resource_usage", key] == u.gpus
        assert m["berth_team_nominal_quota", key] == u.nominal
        assert m["berth_team_resource_borrowed", key] == u.borrowed
        assert m["berth_admitted_active_jobs", (("team", team),)] == u.running
    assert by_name(m, "berth_team_borrowing_limit") == {(("resource", "gpus"), ("team", "a")): 4}
    assert by_name(m, "berth_cluster_gpus") == {
        (("state", "free"),): 1.5,
        (("state", "held"),): 6.5,
        (("state", "stopping"),): 0.0,
    }
    assert by_name(m, "berth_evicted_jobs_total") == {(("reason", "preempted"), ("team", "a")): 1}
    assert by_name(m, "berth_finished_jobs_total") == {(("outcome", "succeeded"), ("team", "b")): 1}
    # Waits: a1 1 s, a2 0.5 s; b1 1 s, c and f 3 s (submitted at 13, admitted at 16). The
    # victim's second admission has not happened, so it is not counted.
    wait = "berth_admission_wait_time_seconds"
    assert m[f"{wait}_count", (("team", "a"),)] == 2 and m[f"{wait}_sum", (("team", "a"),)] == 1.5
    assert m[f"{wait}_count", (("team", "b"),)] == 3 and m[f"{wait}_sum", (("team", "b"),)] == 7
    buckets = {
        dict(k)["le"]: v for k, v in by_name(m, f"{wait}_bucket").items() if ("team", "b") in k
    }
    assert (buckets["1.0"], buckets["2.0"], buckets["4.0"], buckets["+Inf"]) == (1, 1, 3, 3)
    # The loop's pulse: cycles committed and when the last one was; no ETA estimated yet.
    with store.engine.connect() as conn:
        count, last = conn.execute(select(engine_row.c.cycles, engine_row.c.last_cycle_at)).one()
    assert count > 0 and m["berth_scheduling_cycles_total", ()] == count
    assert m["berth_last_cycle_timestamp_seconds", ()] == last
    assert by_name(m, "berth_etas_timestamp_seconds") == {}
    store.estimate_starts(now=40.0)
    assert scrape(client)["berth_etas_timestamp_seconds", ()] == 40.0


def test_model_keys_are_quota_metrics_named_as_teams_yaml_names_them() -> None:
    from plugins.berth_api.metrics import _quotas

    u = TeamUsage(
        "a", 6.0, 8.0, 12.0, 0.0, 0, 2,
        models=(ModelUsage("H100", 5.0, 4.0, 6.0), ModelUsage("A100", 1.0, None, None)),
    )  # fmt: skip
    samples = {
        (family.name, s.labels["resource"]): s.value
        for family in _quotas([u])
        for s in family.samples
        if s.labels["team"] == "a" and s.labels["resource"] != "gpus"
    }
    assert samples == {
        ("berth_team_resource_usage", "gpus.H100"): 5.0,
        ("berth_team_nominal_quota", "gpus.H100"): 4.0,
        ("berth_team_borrowing_limit", "gpus.H100"): 2.0,
        ("berth_team_resource_borrowed", "gpus.H100"): 1.0,
        ("berth_team_resource_usage", "gpus.A100"): 1.0,  # no key for A100: held only
    }


def test_the_grafana_dashboard_queries_only_what_the_plugin_exports(
    store: Store, history: History, client: TestClient
) -> None:
    """docker/grafana/berth-dashboard.json: every panel's query names series a scrape gives
    (a renamed metric would leave a panel empty without a word)."""
    store.estimate_starts(now=40.0)  # so that every gauge has a sample
    exported = {name for name, _ in scrape(client)}
    dashboard = json.loads((REPO / "docker" / "grafana" / "berth-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bberth_[a-z_]+", target["expr"])
    }
    assert len(dashboard["panels"]) >= 8 and len(queried) >= 10
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


def test_every_scrape_reads_the_store_anew(
    store: Store, history: History, client: TestClient
) -> None:
    before = scrape(client)
    assert client.post(f"{API}/jobs/{history.survivor}/cancel").status_code == 200
    store.schedule(now=30.0)  # the victim takes the freed GPUs back
    after = scrape(client)
    cancelled = ("berth_finished_jobs_total", (("outcome", "cancelled"), ("team", "a")))
    assert cancelled not in before and after[cancelled] == 1
    wait = ("berth_admission_wait_time_seconds_count", (("team", "a"),))
    assert (before[wait], after[wait]) == (2, 3)
    assert after["berth_admission_wait_time_seconds_sum", (("team", "a"),)] == 1.5 + 18.0
