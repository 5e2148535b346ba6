"""One cycle poller per process: runs the engine's cycle when the store has changed, and wakes
the jobs that wait for admission.

Every job that waits for admission used to poll the store and run a cycle of its own every
couple of seconds: N waiting jobs cost N locked cycles per period, and a job learned that GPUs
were freed only at its next poll. A `CyclePoller` serves all the waiters of one event loop (on
the embedded default, the triggerer's), and runs a cycle only when one can decide something new:

- it sleeps until a change is committed (wakeup.py: PostgreSQL NOTIFY, a socket on SQLite), a
  trigger of this process pokes it, or `tick_s` passed; then it reads the store's change token
  (the last event id: one indexed read); when it moved (a job submitted, ended, requeued,
  cancelled, or admitted by another process), when a time-based change is due (the last
  cycle's `next_wakeup`: a backoff ending, a reservation coming of age), when `poke()` asked
  (a trigger of this process just freed GPUs), or when the shortest `poll_s` of its waiters
  has passed (a safety net), it reaps dead workers' attempts (at most once per `poll_s`) and
  runs one cycle;
- then it reads the waiting jobs in one query and wakes each one whose wait is over: admitted
  and launchable, running (a launch it does not know of yet), preempting or ended. While an
  admitted job waits for its victims to stop, the poller heartbeats it, so the reaper leaves it.

Cycles are locked transactions in the store (decision 0006), so the pollers of other processes
(another triggerer, a worker's first cycle) may run theirs at the same time: no GPU is given
twice. When the scheduling loop leads (`berth scheduler`, loop.py), the poller runs no cycle
and no reaping: it only reads and answers. The poller lives while it has waiters and ends with
the last one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import time
import weakref
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from berth.store.schema import ADMITTED, QUEUED
from berth.store.store import DEFAULT_LEASE_S, Store
from berth.store.views import JobStatus, UnknownJobError
from berth.store.wakeup import Listener, listen

# The longest a poller sleeps between reads of the change token when no committed change woke
# it (wakeup.py): a safety net, not the way it learns of changes.
TICK_S = 1.0


@dataclass(eq=False)
class _Waiter:
    job_id: str
    poll_s: float
    on_queued: Callable[[JobStatus], None] | None
    done: asyncio.Future[JobStatus] = field(repr=False)
    # The waiter's own context: `on_queued` runs in it. Airflow's triggerer tells which
    # trigger's log a record goes to by context variables bound in each trigger's task
    # (structlog's `trigger_id`); called from the poller's task, every waiter's "why it waits"
    # landed in the log of the trigger that happened to start the poller.
    context: contextvars.Context = field(repr=False, default_factory=contextvars.copy_context)


class CyclePoller:
    """See the module docstring. Get the one for the running event loop with `of(store)`."""

    # event loop -> id(store) -> poller; an ended loop (dag.test() runs each trigger in its
    # own) takes its pollers with it.
    _pollers: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    def __init__(self, store: Store, *, tick_s: float = TICK_S, lease_s: float = DEFAULT_LEASE_S):
        self.store = store
        self.tick_s = tick_s
        self.lease_s = lease_s
        self.cycles = 0  # cycles this poller ran (tests and logs)
        self._waiters: set[_Waiter] = set()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._poked = False

    @classmethod
    def of(cls, store: Store) -> CyclePoller:
        """The poller of `store` in the running event loop (made on first use)."""
        mine = cls._pollers.setdefault(asyncio.get_running_loop(), {})
        poller = mine.get(id(store))
        if poller is None:
            poller = mine[id(store)] = cls(store)
        return poller

    @classmethod
    def poke_running(cls, store: Store) -> None:
        """Ask for a cycle at once, if this event loop has a poller for `store` (GPUs were
        just freed here: whoever waits for them should not wait for the next change check)."""
        with contextlib.suppress(RuntimeError):  # no running loop: nobody to wake here
            poller = cls._pollers.get(asyncio.get_running_loop(), {}).get(id(store))
            if poller is not None:
                poller.poke()

    def poke(self) -> None:
        self._poked = True
        self._wake.set()

    async def wait(
        self,
        job_id: str,
        *,
        poll_s: float = 2.0,
        on_queued: Callable[[JobStatus], None] | None = None,
    ) -> JobStatus:
        """Until the job is admitted and launchable, or running, preempting or ended; returns
        its status then. `on_queued` sees its status after every cycle while it stays queued
        (to say why it waits). Raises what the store raises (UnknownJobError, ...)."""
        if not poll_s > 0:
            raise ValueError(f"poll_s: must be > 0 seconds, got {poll_s!r}")
        waiter = _Waiter(job_id, poll_s, on_queued, asyncio.get_running_loop().create_future())
        self._waiters.add(waiter)
        if self._task is None or self._task.done():
            # In a context of its own, not that of the waiter that happens to start it (whose
            # task log would get whatever the poller's task logs).
            self._task = asyncio.create_task(
                self._run(), name="berth-cycle-poller", context=contextvars.Context()
            )
        self.poke()  # a new waiter deserves a cycle now
        try:
            return await waiter.done
        finally:
            self._waiters.discard(waiter)

    async def _run(self) -> None:
        listener = await asyncio.to_thread(listen, self.store.engine)
        heard: asyncio.Future | None = None
        seen: int | None = None
        last_cycle = last_reap = -math.inf
        next_wakeup: float | None = None
        try:
            while self._waiters:
                token = await asyncio.to_thread(self.store.change_token)
                poll_s = min(w.poll_s for w in self._waiters)
                now = time.monotonic()
                if (
                    self._poked
                    or token != seen
                    or now - last_cycle >= poll_s
                    or (next_wakeup is not None and time.time() >= next_wakeup)
                ):
                    self._poked = False
                    # The token from before the cycle: the cycle's own admissions move it, so
                    # the next tick runs one more cycle (which then finds nothing new to do).
                    seen = token
                    # The scheduling loop, when one leads, decides (and reaps); a cycle here
                    # would only make it rebuild its state. Then only the answers are ours.
                    if await asyncio.to_thread(self.store.loop_holder) is None:
                        if now - last_reap >= poll_s:
                            await asyncio.to_thread(self.store.reap, lease_s=self.lease_s)
                            last_reap = now
                        report = await asyncio.to_thread(self.store.schedule)
                        self.cycles += 1
                        next_wakeup = report.next_wakeup
                    last_cycle = time.monotonic()
                    await self._answer()
                self._wake.clear()
                heard = await self._sleep(listener, heard)
        except Exception as e:  # the store failed: every waiter hears it, none hangs
            for w in list(self._waiters):
                if not w.done.done():
                    w.done.set_exception(e)
        finally:
            if heard is not None:  # its thread still listens: let it end before closing
                await asyncio.wait({heard}, timeout=self.tick_s + 5.0)
            listener.close()

    async def _sleep(self, listener: Listener, heard: asyncio.Future | None) -> asyncio.Future:
        """Until a change is committed (the listener, in a thread), `poke()`, or `tick_s`.
        Returns the listening future, still running if something else woke the poller."""
        if heard is None or heard.done():
            heard = asyncio.ensure_future(asyncio.to_thread(listener.wait, self.tick_s))
        poked = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({heard, poked}, timeout=self.tick_s, return_when=FIRST_COMPLETED)
        poked.cancel()
        return heard

    async def _answer(self) -> None:
        waiters = [w for w in self._waiters if not w.done.done()]
        if not waiters:
            return
        found = await asyncio.to_thread(self.store.statuses, {w.job_id for w in waiters})
        for w in waiters:
            st = found.get(w.job_id)
            if st is None:
                w.done.set_exception(
                    UnknownJobError(f"job_id: no job {w.job_id!r}; it was never submitted")
                )
            elif st.state == QUEUED:
                if w.on_queued is not None:
                    w.context.run(w.on_queued, st)
            elif st.state != ADMITTED or await asyncio.to_thread(self.store.launchable, w.job_id):
                w.done.set_result(st)
            else:  # admitted over victims still stopping: keep its lease while they stop
                await asyncio.to_thread(self.store.heartbeat, w.job_id)
                if w.on_queued is not None:
                    w.context.run(w.on_queued, st)
