"""`berth scheduler`: the long-lived scheduling loop (berth/store/loop.py).

Run one next to Airflow (scripts/demo.sh does on the embedded default) or two for failover:
the one holding the store's lease decides, the other stands by. SIGTERM or Ctrl-C stops it
after the current cycle and hands the lease over at once.
"""

from __future__ import annotations

import logging
import signal
from typing import Annotated

import typer

from berth.settings import settings


def register(app: typer.Typer) -> None:
    app.command("scheduler")(scheduler)


def scheduler(
    ttl_s: Annotated[
        float, typer.Option(help="the lease: a standby takes over this long after a crash")
    ] = 15.0,
    check_s: Annotated[
        float, typer.Option(help="longest sleep between looks at the store, woken or not")
    ] = 1.0,
    self_check_every_s: Annotated[
        float, typer.Option(help="compare the in-memory state with a rebuild this often")
    ] = 600.0,
    eta_every_s: Annotated[
        float,
        typer.Option(help="estimate the waiting jobs' starts this often (0: never)"),
    ] = 30.0,
    max_cycles: Annotated[int | None, typer.Option(help="stop after this many cycles")] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="serve Prometheus metrics (cycle duration, decisions, leadership) on this port"
        ),
    ] = None,
) -> None:
    """Run the scheduling loop until stopped (SIGTERM, Ctrl-C)."""
    from berth.store.loop import SchedulingLoop  # SQLAlchemy loads only here

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    hooks = {}
    if metrics_port is not None:
        from berth.loop_metrics import LoopMetrics

        metrics = LoopMetrics()
        metrics.serve(metrics_port)
        hooks = {"on_cycle": metrics.on_cycle, "on_lead": metrics.on_lead}
        logging.info("metrics on :%d/metrics", metrics_port)
    loop = SchedulingLoop(
        settings().store(),
        ttl_s=ttl_s,
        check_s=check_s,
        self_check_every_s=self_check_every_s,
        eta_every_s=eta_every_s,
        **hooks,
    )

    def stop(signum: int, _frame: object) -> None:
        logging.info("signal %d: stopping after this cycle", signum)
        loop.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stats = loop.run(max_cycles=max_cycles)
    logging.info(
        "stopped: %d cycles, %d skipped (nothing new), %d self-checks, %d errors",
        stats.cycles,
        stats.skipped,
        stats.self_checks,
        stats.errors,
    )
