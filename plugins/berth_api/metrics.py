"""`/berth/metrics`: the store's state in Prometheus' text format, read at every scrape.

A custom collector reads the store when Prometheus asks, instead of counters kept in the API
server's memory: those would count only what one worker process saw and start again at zero
with every restart, while the store holds what every process did. Counters (`_total`) come
from the audit log, so they only grow (events are never deleted).

Names follow Kueue's where Kueue has the metric (a team is Kueue's ClusterQueue):

| metric | type | labels | what |
| --- | --- | --- | --- |
| berth_pending_jobs | gauge | team, reason | queued jobs by pending reason (1) |
| berth_admitted_active_jobs | gauge | team | admitted or running jobs |
| berth_team_resource_usage | gauge | team, resource | GPUs held (admitted, running) |
| berth_team_nominal_quota | gauge | team, resource | nominal GPUs (2) |
| berth_team_borrowing_limit | gauge | team, resource | GPUs it may borrow (2) |
| berth_team_resource_borrowed | gauge | team, resource | GPUs held above nominal |
| berth_cluster_gpus | gauge | state | free, held, stopping (3) |
| berth_evicted_jobs_total | counter | team, reason | jobs preempted ("preempted") |
| berth_finished_jobs_total | counter | team, outcome | jobs ended, by outcome (4) |
| berth_admission_wait_time_seconds | histogram | team | from entering the queue to admission |
| berth_scheduling_cycles | counter | | cycles committed by the store |
| berth_last_cycle_timestamp_seconds | gauge | | when the last cycle committed (5) |
| berth_etas_timestamp_seconds | gauge | | when the waiting jobs' ETAs were last estimated (5) |

(1) "unexamined": no cycle looked at the job yet. (2) Absent when the quota does not limit
GPUs. (3) They add up to the cluster's GPUs, shared ones in fractions; stopping: a preempted
job's replicas are still on it. (4) succeeded, failed, cancelled, rejected; a retried job
counts once per failed attempt. (5) Absent before the first (the ETAs' also while no job
waits: the table holds only waiting jobs'); `time() - ...` alerts on a loop that stopped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from berth.store import Store, TeamUsage
from berth.store.aggregates import (
    admission_waits,
    cycles,
    ends_by_team,
    holdings,
    pending_by_reason,
    preemptions_by_team,
)
from plugins.berth_api.gpu_map import gpu_map, gpus_by_state
from plugins.berth_api.source import StoreDep
from scheduling.quota import quota_key

GPUS = "gpus"  # the resource label, as quotas name it in teams.yaml
UNEXAMINED = "unexamined"
# Kueue's admission wait buckets: 1 s doubling to 8192 s (about 2.3 hours), then +Inf.
WAIT_BUCKETS = tuple(2.0**i for i in range(14))


class StoreCollector(Collector):
    """Every Berth metric, made from the store when collected."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def describe(self) -> list[Metric]:
        return []  # registering must not read the store: only a scrape does

    def collect(self) -> Iterator[Metric]:
        store = self._store
        usage = list(store.usage().values())  # one read for both families
        yield from _queues(store, usage)
        yield from _quotas(usage)
        yield _cluster(store)
        yield from _history(store)
        yield from _loop(store)


router = APIRouter(tags=["Berth"])


@router.get("/metrics", response_class=Response)
def metrics(store: StoreDep) -> Response:
    """Berth's queue, quotas, GPUs and history in Prometheus' text format. No login: see
    docs/decisions/0015-berth-plugin-api.md."""
    # A registry of its own, not the process-wide one: only Berth's metrics, not those of
    # whichever API server worker happened to answer.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _queues(store: Store, usage: list[TeamUsage]) -> Iterator[Metric]:
    pending = GaugeMetricFamily(
        "berth_pending_jobs",
        "Jobs waiting for admission, by pending reason",
        labels=["team", "reason"],
    )
    for (team, reason), n in sorted(pending_by_reason(store).items(), key=str):
        pending.add_metric([team, reason or UNEXAMINED], n)
    yield pending
    active = GaugeMetricFamily(
        "berth_admitted_active_jobs", "Jobs admitted or running", labels=["team"]
    )
    for u in usage:
        active.add_metric([u.team], u.running)
    yield active


def _quotas(usage: list[TeamUsage]) -> Iterator[Metric]:
    labels = ["team", "resource"]
    held = GaugeMetricFamily(
        "berth_team_resource_usage", "GPUs held by admitted and running jobs", labels=labels
    )
    nominal = GaugeMetricFamily(
        "berth_team_nominal_quota", "Nominal (guaranteed) GPUs", labels=labels
    )
    borrowing = GaugeMetricFamily(
        "berth_team_borrowing_limit", "GPUs the team may borrow above nominal", labels=labels
    )
    borrowed = GaugeMetricFamily(
        "berth_team_resource_borrowed", "GPUs held above nominal", labels=labels
    )
    for u in usage:
        key = [u.team, GPUS]
        held.add_metric(key, u.gpus)
        borrowed.add_metric(key, u.borrowed)
        if math.isfinite(u.nominal):  # a quota that does not limit is left out, not +Inf
            nominal.add_metric(key, u.nominal)
            if math.isfinite(u.ceiling):
                borrowing.add_metric(key, u.ceiling - u.nominal)
        # Per GPU model, the resource named as teams.yaml names its key (`gpus.H100`,
        # `mig.1g.10gb` in instances), as Kueue labels its quota metrics by flavor; a model no
        # team has a key for: held only.
        for m in u.models:
            key = [u.team, quota_key(m.model)]
            held.add_metric(key, m.gpus)
            if m.nominal is None:
                continue
            nominal.add_metric(key, m.nominal)
            borrowed.add_metric(key, max(0.0, m.gpus - m.nominal))
            if m.ceiling is not None and math.isfinite(m.ceiling):
                borrowing.add_metric(key, m.ceiling - m.nominal)
    yield from (held, nominal, borrowing, borrowed)


def _cluster(store: Store) -> Metric:
    gpus = GaugeMetricFamily(
        "berth_cluster_gpus",
        "The cluster's GPUs: free, held by admitted and running jobs, or stopping",
        labels=["state"],
    )
    for state, n in gpus_by_state(gpu_map(store.cluster, holdings(store))).items():
        gpus.add_metric([state], n)
    return gpus


def _history(store: Store) -> Iterator[Metric]:
    evicted = CounterMetricFamily(
        "berth_evicted_jobs", "Jobs evicted from their GPUs", labels=["team", "reason"]
    )
    for team, n in sorted(preemptions_by_team(store).items()):
        evicted.add_metric([team, "preempted"], n)
    yield evicted
    finished = CounterMetricFamily(
        "berth_finished_jobs", "Jobs ended, by outcome", labels=["team", "outcome"]
    )
    for (team, outcome), n in sorted(ends_by_team(store).items()):
        finished.add_metric([team, outcome], n)
    yield finished
    yield _waits(admission_waits(store))


def _loop(store: Store) -> Iterator[Metric]:
    c = cycles(store)
    count = CounterMetricFamily("berth_scheduling_cycles", "Scheduling cycles committed")
    count.add_metric([], c.count)
    yield count
    for name, doc, value in (
        ("berth_last_cycle_timestamp_seconds", "When the last cycle committed", c.last_at),
        ("berth_etas_timestamp_seconds", "When the ETAs were last estimated", c.etas_at),
    ):
        gauge = GaugeMetricFamily(name, doc)
        if value is not None:
            gauge.add_metric([], value)
        yield gauge


def _waits(waits: list[tuple[str, float]]) -> Metric:
    by_team: dict[str, list[float]] = defaultdict(list)
    for team, seconds in waits:
        by_team[team].append(seconds)
    hist = HistogramMetricFamily(
        "berth_admission_wait_time_seconds",
        "Seconds from entering the queue to admission",
        labels=["team"],
    )
    for team, seconds in sorted(by_team.items()):
        buckets = [(floatToGoString(b), float(sum(s <= b for s in seconds))) for b in WAIT_BUCKETS]
        buckets.append(("+Inf", float(len(seconds))))
        hist.add_metric([team], buckets, sum_value=sum(seconds))
    return hist
