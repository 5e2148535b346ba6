"""The waiting halves of the run task: admission, then completion, each an async trigger.

Both carry only ids and numbers in their kwargs (what `serialize()` returns is stored in
Airflow's database); the store URL and paths come from the triggerer's environment
(`operators.context`), so no credential is written into a trigger row.

The store and the local runtime are synchronous (SQLAlchemy, /proc), so each call runs in a
thread (`asyncio.to_thread`) and the triggerer's event loop never blocks on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.context import settings
from scheduling.store import DEFAULT_LEASE_S, StaleAttemptError, UnknownJobError

# A trigger that fires within seconds of its deferral can race Airflow 3.3's scheduler: the
# resumed try may already run when the executor's stale "success" of the deferring process is
# processed, and the scheduler then fails the running try (apache/airflow#72716, #71580).
# So an event is held back until the trigger is this old; only very quick answers wait.
MIN_EVENT_AGE_S = 8.0


async def _not_before(started: float) -> None:
    """Wait out the rest of MIN_EVENT_AGE_S since `started` (time.monotonic())."""
    left = MIN_EVENT_AGE_S - (time.monotonic() - started)
    if left > 0:
        await asyncio.sleep(left)


class AdmissionTrigger(BaseTrigger):
    """Wait until the job is admitted AND launchable, running the engine cycle itself.

    Every poll runs `store.reap()` (a dead worker's GPUs come back) and `store.schedule()`: the
    engine has no daemon of its own on the embedded default; any number of these triggers may
    run cycles at once because each cycle is one locked transaction. While its job waits it logs
    the reason and queue position whenever they change, so the task log says why it waits.
    Fires `{"status": "admitted", "attempt": n}` or, if the job ended meanwhile (cancelled,
    rejected), `{"status": <state>, "message": ...}`.
    """

    def __init__(self, job_id: str, poll_s: float = 2.0, lease_s: float = DEFAULT_LEASE_S):
        super().__init__()
        self.job_id = job_id
        self.poll_s = poll_s
        self.lease_s = lease_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs = {"job_id": self.job_id, "poll_s": self.poll_s, "lease_s": self.lease_s}
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    async def run(self) -> AsyncIterator[TriggerEvent]:
        store = settings().store()
        said = None
        started = time.monotonic()
        while True:
            await asyncio.to_thread(store.reap, lease_s=self.lease_s)
            report = await asyncio.to_thread(store.schedule)
            st = await asyncio.to_thread(store.status, self.job_id)
            if st.state == "admitted":
                if await asyncio.to_thread(store.launchable, self.job_id):
                    await _not_before(started)
                    yield self._event("admitted", attempt=st.attempt)
                    return
                # Admitted over preempted jobs still stopping: keep the lease while they stop.
                await asyncio.to_thread(store.heartbeat, self.job_id)
                why = f"admitted; waiting for {', '.join(st.waits_for)} to stop"
            elif st.state == "running":  # a resumed task whose launch already happened
                yield self._event("running", attempt=st.attempt)
                return
            elif st.terminal or st.state == "preempting":
                yield self._event(st.state, attempt=st.attempt, message=st.message or "")
                return
            else:
                why = f"queued: {st.reason_code or 'pending'} {st.reason_message or ''}".strip()
                if st.position is not None:
                    why += f" (position {st.position} in team {st.team}'s queue)"
            if why != said:
                self.log.info("job %s %s", self.job_id, why)
                said = why
            delay = self.poll_s
            if report.next_wakeup is not None:
                delay = max(0.05, min(delay, report.next_wakeup - time.time()))
            await asyncio.sleep(delay)

    def _event(self, status: str, **data: Any) -> TriggerEvent:
        # Everything the operator needs travels in the event: dag.test() resumes the task with
        # the event alone, without the kwargs given to defer().
        return TriggerEvent({"status": status, "job_id": self.job_id, **data})

    async def on_kill(self) -> None:
        """The user killed the waiting task: take the job out of the queue."""
        store = settings().store()
        with contextlib.suppress(UnknownJobError):
            await asyncio.to_thread(store.cancel, self.job_id, message="task killed by a user")


class CompletionTrigger(BaseTrigger):
    """Watch a launched attempt until its gang ends (the runtime enforces the time limit) or
    the store says it is preempted or cancelled.

    Every poll: the runtime's gang status, the replicas' new log lines into the task log (a
    restarted triggerer streams them again from the cursor it was deferred with), and the
    job's state in the store (a cycle elsewhere may have chosen it as a victim:
    `preempting`, or someone cancelled it). Every `heartbeat_s` it heartbeats the store so the
    reaper leaves the attempt alone. Fires `{"status": succeeded | failed | stopped |
    preempting | cancelled | lost, ...}`; the operator acts on it (stop, finish, retry, requeue).
    """

    def __init__(
        self,
        job_id: str,
        attempt: int,
        launch: dict[str, Any],
        poll_s: float = 2.0,
        heartbeat_s: float = 10.0,
        cursor: Any = None,
    ):
        super().__init__()
        self.job_id = job_id
        self.attempt = attempt
        self.launch = launch
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.cursor = cursor
        self._said_no_logs = False

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "launch": self.launch,
            "poll_s": self.poll_s,
            "heartbeat_s": self.heartbeat_s,
            "cursor": self.cursor,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        s = settings()
        store, runtime = s.store(), s.runtime()
        launch = runtime.launch_from_dict(self.launch)
        last_beat = 0.0
        started = time.monotonic()
        while True:
            gang = await asyncio.to_thread(runtime.poll, launch)
            await self._stream(runtime, launch)
            if gang.state != "running":
                await _not_before(started)
                yield self._event(
                    gang.state,
                    exit_code=gang.exit_code,
                    rank=gang.failed_rank,
                    reason=gang.reason,
                    message=gang.message,
                    tail=list(gang.log_tail),
                    # Kubernetes tells a requeue (eviction, node loss) and a hopeless failure
                    # (bad image) from a failed attempt; the local runtime has no such cases.
                    disposition=getattr(gang, "disposition", None),
                )
                return
            try:
                if time.monotonic() - last_beat >= self.heartbeat_s:
                    kw = {"attempt": self.attempt}
                    st = await asyncio.to_thread(store.heartbeat, self.job_id, **kw)
                    last_beat = time.monotonic()
                else:
                    st = await asyncio.to_thread(store.status, self.job_id)
            except StaleAttemptError as e:  # reaped while we were silent: this attempt is over
                yield self._event("lost", message=str(e))
                return
            if st.state in ("preempting", "cancelled"):
                yield self._event(st.state, message=st.message or "")
                return
            await asyncio.sleep(self.poll_s)

    def _event(self, status: str, **data: Any) -> TriggerEvent:
        ids = {"job_id": self.job_id, "attempt": self.attempt, "launch": self.launch}
        return TriggerEvent({"status": status, **ids, **data})

    async def _stream(self, runtime: Any, launch: Any) -> None:
        """New replica log lines into the task log (the triggerer routes them there)."""
        from scheduling.runtime import LogCursor

        cursor = LogCursor.from_dict(self.cursor) if self.cursor else None
        try:
            lines, cursor = await asyncio.to_thread(runtime.logs, launch, cursor)
        except RuntimeError as e:  # e.g. a kubelet that cannot serve the log (LogsUnavailable)
            if not self._said_no_logs:
                self.log.warning("replica logs unavailable: %s", e)
                self._said_no_logs = True
            return
        self.cursor = cursor.to_dict()
        for line in lines:
            self.log.info("%s", line)

    async def on_kill(self) -> None:
        """The user killed or marked the task: stop the replicas, free the GPUs."""
        s = settings()
        runtime = s.runtime()
        await asyncio.to_thread(runtime.stop, runtime.launch_from_dict(self.launch))
        with contextlib.suppress(UnknownJobError):
            await asyncio.to_thread(s.store().cancel, self.job_id, message="task killed by a user")
