"""The scheduling loop: one long-lived process decides every cycle, woken by committed changes.

`berth scheduler` runs it (on the embedded default next to Airflow; in the cluster as its own
Deployment, two replicas for failover). Each loop claims the store's lease (lease.py); the one
that holds it is the leader, the others stand by and take over when its lease expires (it
died, or lost the database). The leader:

- keeps the engine's state in memory (mirror.py): built once, then caught up from the changes
  since its last cycle; the Store's locked section shrinks to "check, write" (apply.py);
- sleeps until a committed change wakes it (wakeup.py: PostgreSQL NOTIFY, a socket on SQLite),
  a time-based change is due (`CycleReport.next_wakeup`), or `check_s` passed; then runs a
  cycle if anything changed since its last one (a burst of changes shares one cycle, and its
  own commit's wake-up finds nothing new);
- renews its lease every `ttl_s / 3`; its cycles commit only while it holds it (a fence);
- estimates every waiting job's start every `eta_every_s` when cycles ran since (at least every
  `ETA_STALE_S`, as running jobs age): the engine run forward from its state (etas.py);
- reaps dead workers' attempts every `reap_every_s`, and compares its state with a rebuild
  every `self_check_every_s` (`Store.self_check`), raising if they differ: the process exits
  and a standby takes over with a fresh build.

Failover time: the leader renews every `ttl_s / 3` and a standby tries to claim as often, so a
standby leads at most `ttl_s + ttl_s / 3` after the leader died (20 s by default; 3.1 s measured
with `ttl_s` 3 in tests/test_loop.py); a leader stopped cleanly (SIGTERM) releases the lease at
once, and the standby takes it at its next try.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from berth.store.lease import Lease, LeaseLost
from berth.store.store import DEFAULT_LEASE_S, Store
from berth.store.views import CycleReport
from berth.store.wakeup import Listener, listen

log = logging.getLogger(__name__)
STOP_SLICE_S = 0.5  # the longest a stopped loop sleeps on
ETA_STALE_S = 300.0  # ETAs are estimated again this often even when nothing was decided


@dataclass
class LoopStats:
    cycles: int = 0
    skipped: int = 0  # woken, but nothing had changed since the last cycle
    self_checks: int = 0
    etas: int = 0  # jobs with an ETA at the last estimate
    errors: int = 0
    leader_since: float | None = None
    last: CycleReport | None = field(default=None, repr=False)


class SchedulingLoop:
    """See the module docstring. `run()` until `stop` is set (or `max_cycles` ran)."""

    def __init__(
        self,
        store: Store,
        *,
        ttl_s: float = 15.0,
        check_s: float = 1.0,
        reap_every_s: float = 30.0,
        worker_lease_s: float = DEFAULT_LEASE_S,
        self_check_every_s: float = 600.0,
        eta_every_s: float = 30.0,
        holder: str = "",
        on_cycle: Callable[[CycleReport, float], None] | None = None,
        on_lead: Callable[[bool], None] | None = None,
    ) -> None:
        """`on_cycle(report, seconds)` hears every committed cycle and how long it took, wall
        clock, from the look at the store to the commit; `on_lead(leading)` every change of
        leadership (berth/loop_metrics.py exports both to Prometheus)."""
        for name, value in (("ttl_s", ttl_s), ("check_s", check_s)):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {value!r}")
        self.store = store
        self.lease = Lease(store.engine, ttl_s=ttl_s, holder=holder)
        self.check_s = check_s
        self.reap_every_s = reap_every_s
        self.worker_lease_s = worker_lease_s
        self.self_check_every_s = self_check_every_s
        self.eta_every_s = eta_every_s  # 0: no ETAs
        self._estimating: threading.Thread | None = None
        self.on_cycle = on_cycle
        self.on_lead = on_lead
        self.stats = LoopStats()
        self.stop = threading.Event()

    @property
    def leader(self) -> bool:
        return self.lease.epoch is not None

    def run(self, max_cycles: int | None = None) -> LoopStats:
        listener = listen(self.store.engine)
        renew_at = last_reap = last_check = last_cycle = last_eta = -math.inf
        eta_cycles = -1
        next_wakeup: float | None = None
        woken = True
        try:
            while not self.stop.is_set():
                now = time.time()
                if now >= renew_at:
                    was = self.leader
                    try:
                        held = self.lease.claim(now)
                    except Exception:  # the database is away: stand by, try again
                        log.exception("could not claim the scheduling lease")
                        held = False
                        self.lease.epoch = None
                    renew_at = now + self.lease.ttl_s / 3
                    if held and not was:
                        log.info("leading the scheduling loop (%s)", self.lease.holder)
                        self.stats.leader_since = now
                        woken = True
                    elif was and not held:
                        log.warning("lost the scheduling lease; standing by")
                        self.stats.leader_since = None
                    if held != was and self.on_lead is not None:
                        self.on_lead(held)
                if self.leader:
                    try:
                        if now - last_reap >= self.reap_every_s:
                            self.store.reap(now, lease_s=self.worker_lease_s)
                            last_reap = now
                        due = next_wakeup is not None and now >= next_wakeup
                        if woken or due or now - last_cycle >= self.check_s:
                            if due or self.store.changed():
                                began = time.perf_counter()
                                report = self.store.schedule(now, lease=self.lease)
                                if self.on_cycle is not None:
                                    self.on_cycle(report, time.perf_counter() - began)
                                next_wakeup = report.next_wakeup
                                self.stats.cycles += 1
                                self.stats.last = report
                                last_cycle = now
                            else:
                                self.stats.skipped += 1
                        if (
                            self.eta_every_s > 0
                            and now - last_eta >= self.eta_every_s
                            and (eta_cycles != self.stats.cycles or now - last_eta >= ETA_STALE_S)
                        ):
                            cycles = self.stats.cycles
                            if self._estimate(now):  # else the last one still runs: next tick
                                last_eta, eta_cycles = now, cycles
                        if now - last_check >= self.self_check_every_s:
                            self.store.self_check()  # MirrorDiverged propagates: a bug
                            self.stats.self_checks += 1
                            last_check = now
                    except LeaseLost as e:
                        log.warning("%s; standing by", e)
                        self.stats.leader_since = None
                        if self.on_lead is not None:
                            self.on_lead(False)
                    except AssertionError:  # MirrorDiverged: a bug; let a fresh process take over
                        raise
                    except Exception:  # the database went away, say: try again, keep the lease
                        log.exception("scheduling cycle failed; retrying")
                        self.stats.errors += 1
                        self.stop.wait(min(self.check_s, 1.0))
                    if max_cycles is not None and self.stats.cycles >= max_cycles:
                        break
                timeout = min(self.check_s, max(0.0, renew_at - time.time()))
                if next_wakeup is not None:
                    timeout = min(timeout, max(0.0, next_wakeup - time.time()))
                woken = self._sleep(listener, timeout)
        finally:
            listener.close()
            if self._estimating is not None:
                self._estimating.join()  # it reads and writes the store: not past the stop
            if self.leader:
                self.lease.release()
                if self.on_lead is not None:
                    self.on_lead(False)
        return self.stats

    def _estimate(self, now: float) -> bool:
        """Refresh the ETAs in a thread of their own, one at a time: a forward run over a long
        queue takes seconds (decision 0016), while cycles must go on. Its only moment under
        the runner's lock is the copy of the state. A failure is logged, not fatal. False
        when the last one still runs (nothing started)."""
        if self._estimating is not None and self._estimating.is_alive():
            return False

        def run() -> None:
            try:
                self.stats.etas = self.store.estimate_starts(now)
            except Exception:
                log.exception("estimating the waiting jobs' starts failed")

        self._estimating = threading.Thread(target=run, name="berth-eta", daemon=True)
        self._estimating.start()
        return True

    def _sleep(self, listener: Listener, timeout: float) -> bool:
        """Until woken (True) or `timeout`; in slices, so that `stop` is seen within one."""
        deadline = time.monotonic() + timeout
        while not self.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if listener.wait(min(left, STOP_SLICE_S)):
                return True
        return False
