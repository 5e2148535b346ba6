"""The scheduling loop's own Prometheus metrics, served by `berth scheduler --metrics-port`.

What only the loop process knows, as Kueue's controller exports its admission cycle: how long
each cycle takes and whether this process leads. Everything read from the store (queues,
quotas, outcomes) is the plugin's `/berth/metrics` (plugins/berth_api/metrics.py), the same
from every API server worker; these live in the loop's memory and restart with it.

| metric | type | what |
| --- | --- | --- |
| berth_admission_cycle_duration_seconds | histogram | one committed cycle, look to commit |
| berth_admission_cycle_decisions_total | counter, by decision | admitted, preempted, rejected |
| berth_scheduling_loop_leader | gauge | 1 while this process holds the lease |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from berth.store.views import CycleReport

# From a fast cycle on the embedded default (~1 ms) to a slow one at 10,000 pending jobs.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopMetrics:
    """The metrics of one loop, in a registry of their own (not the process-global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.duration = Histogram(
            "berth_admission_cycle_duration_seconds",
            "Wall time of one committed scheduling cycle, from the look at the store to the commit",
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "berth_admission_cycle_decisions",
            "Decisions committed by this loop's cycles",
            ["decision"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "berth_scheduling_loop_leader",
            "1 while this process holds the scheduling lease and decides",
            registry=self.registry,
        )

    def on_cycle(self, report: CycleReport, seconds: float) -> None:
        self.duration.observe(seconds)
        for decision, ids in (
            ("admitted", report.admitted),
            ("preempted", report.preempted),
            ("rejected", report.rejected),
        ):
            if ids:
                self.decisions.labels(decision).inc(len(ids))

    def on_lead(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve `/metrics` on `port` from a daemon thread (prometheus_client's server)."""
        start_http_server(port, addr=addr, registry=self.registry)
