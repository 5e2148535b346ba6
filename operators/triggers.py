"""The waiting halves of the run task: admission and launch, then completion, each an async
trigger.

Both carry only plain data in their kwargs (what `serialize()` returns is stored in Airflow's
database): ids, numbers, and the admission trigger's launch plan (the spec, the replicas'
platform variables, the task's identity). The store URL and paths come from the triggerer's
environment (`operators.context`), so no credential is written into a trigger row.

What happens in the triggers rather than in a resumed task, and why: a resumed task waits for
the scheduler and starts a new task process (seconds). So the admission trigger launches the
gang itself as soon as the cycle admits the job, and the completion trigger ends the attempt in
the store (freeing its GPUs, and poking this process's cycle poller) as soon as the gang ends;
the task resumes afterwards to do what needs Airflow (XCom, retries, artifacts, MLflow).

The store and the runtimes are synchronous (SQLAlchemy, /proc, HTTP), so each call runs in a
thread (`asyncio.to_thread`) and the triggerer's event loop never blocks on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from berth.runtime.base import RuntimeUnavailable
from berth.store import JobStateError, JobStatus, StaleAttemptError, UnknownJobError
from berth.store.poller import CyclePoller
from operators.context import settings
from operators.launching import (
    LaunchBusy,
    LaunchFailed,
    LaunchInterrupted,
    LaunchPlan,
    launch_attempt,
)
from operators.notifying import job_fields
from operators.release import release_job
from operators.run_work import waited_of, where_of

# A trigger that fires within seconds of its deferral can race Airflow 3.3's scheduler: the
# resumed try may already run when the executor's stale "success" of the deferring process is
# processed, and the scheduler then fails the running try (apache/airflow#72716, #71580).
# So an event is held back until the trigger is this old; only very quick answers wait. The
# work itself (a launch, the end of an attempt) is never held back, only the event.
MIN_EVENT_AGE_S = 8.0
# How often a waiting job's trigger reads its ETA (the loop refreshes them every 30 s).
ETA_EVERY_S = 30.0


async def not_before(started: float) -> None:
    """Wait out the rest of MIN_EVENT_AGE_S since `started` (time.monotonic())."""
    left = MIN_EVENT_AGE_S - (time.monotonic() - started)
    if left > 0:
        await asyncio.sleep(left)


class AdmissionTrigger(BaseTrigger):
    """Wait until the job is admitted and launchable, then launch it.

    The waiting is this process's `CyclePoller` (one engine cycle when the store changed, for
    all waiting jobs at once; on the embedded default there is no engine daemon). While the job
    waits the trigger logs its reason and queue position whenever they change, and its expected
    start (the scheduling loop's ETA) when that moves by a minute or more, so the task log says
    why it waits and until when. Once admitted, the trigger launches the gang (`launch_attempt`)
    and fires `{"status": "running", "attempt": n, "launch": {...}, "mlflow_url": ...}` with
    where it runs, how long it waited and the job's fields for a notice (the task reads no
    store: decision 0030); a
    launch that failed fires `launch_failed` (the store has the attempt as failed). A job found
    running (a launch it did not make) fires `running` without a launch; one that ended
    meanwhile (cancelled, rejected) or is being preempted fires its state. With `notify_at`, a
    job still waiting then fires `waiting` (with its plan) for the operator's notification.
    """

    def __init__(
        self,
        job_id: str,
        plan: dict[str, Any],
        poll_s: float = 2.0,
        notify_at: float | None = None,
    ):
        super().__init__()
        self.job_id = job_id
        self.plan = plan
        self.poll_s = poll_s
        # Wall-clock time at which a job still waiting fires `waiting` (with its plan, so that
        # the operator can notify and wait again): the "waiting too long" notification.
        self.notify_at = notify_at

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs = {
            "job_id": self.job_id,
            "plan": self.plan,
            "poll_s": self.poll_s,
            "notify_at": self.notify_at,
        }
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    async def run(self) -> AsyncIterator[TriggerEvent]:
        store = settings().store()
        poller = CyclePoller.of(store)
        started = time.monotonic()
        said: list[str] = []
        # In this trigger's own context (a task copies it), so its lines reach this job's log.
        etas = asyncio.create_task(self._say_etas(store))
        try:
            async for event in self._wait(store, poller, started, said):
                yield event
                return
        finally:
            etas.cancel()

    async def _wait(
        self, store: Any, poller: CyclePoller, started: float, said: list[str]
    ) -> AsyncIterator[TriggerEvent]:
        plan = LaunchPlan.from_dict(self.plan)
        busy = ""  # what LaunchBusy said last, said once
        while True:
            waiting = poller.wait(
                self.job_id, poll_s=self.poll_s, on_queued=lambda st: self._say(st, said)
            )
            left = None if self.notify_at is None else max(0.0, self.notify_at - time.time())
            try:
                st = await asyncio.wait_for(waiting, left)
            except TimeoutError:  # still waiting at notify_at
                st = await asyncio.to_thread(store.status, self.job_id)
                eta = (await asyncio.to_thread(store.etas, [self.job_id])).get(self.job_id)
                await not_before(started)
                why = f"{st.reason_code or 'pending'}: {st.reason_message or ''}".strip()
                yield self._event(
                    "waiting",
                    plan=self.plan,
                    why=why,
                    eta=None if eta is None else eta.at,
                    job=job_fields(st),
                )
                return
            if st.state != "admitted":  # running (launched elsewhere), preempting, or ended
                await not_before(started)
                yield self._event(
                    st.state,
                    attempt=st.attempt,
                    message=st.message or "",
                    team=st.team,
                    job=job_fields(st),
                )
                return
            try:
                launched = await asyncio.to_thread(launch_attempt, plan, self.job_id, st.attempt)
            except LaunchBusy as e:  # another launcher has it: look again in a while
                if busy != str(e):
                    self.log.info("%s", e)
                    busy = str(e)
                await asyncio.sleep(self.poll_s)
                continue
            except LaunchInterrupted as e:  # requeued: wait again
                self.log.warning("%s", e)
                continue
            except LaunchFailed as e:
                await not_before(started)
                yield self._event("launch_failed", attempt=st.attempt, message=str(e))
                return
            self.log.info("job %s attempt %d started", self.job_id, launched.attempt)
            st = await asyncio.to_thread(store.status, self.job_id)
            await not_before(started)
            yield self._event(
                "running",
                attempt=launched.attempt,
                launch=launched.launch,
                mlflow_url=launched.mlflow_url,
                # What the task says and hands on, so that it needs no store (decision 0030).
                team=st.team,
                where=where_of(st),
                waited_s=waited_of(st),
                job=job_fields(st),
            )
            return

    async def _say_etas(self, store: Any) -> None:
        """Log the job's expected start whenever it moves by a minute or more (the scheduling
        loop refreshes ETAs about every 30 s; with no loop there are none, and nothing is said)."""
        last: tuple[int, str] | None = None
        while True:
            try:
                eta = (await asyncio.to_thread(store.etas, [self.job_id])).get(self.job_id)
            except Exception as e:  # the store away for a moment: the wait itself says so
                self.log.debug("job %s: no ETA read (%s)", self.job_id, e)
                eta = None
            if eta is not None and (now := (round(eta.at / 60), eta.basis)) != last:
                last = now
                at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(eta.at))
                basis = "at the latest, from time limits" if eta.basis == "limits" else "estimate"
                self.log.info("job %s expected to start %s UTC (%s)", self.job_id, at, basis)
            await asyncio.sleep(ETA_EVERY_S)

    def _say(self, st: JobStatus, said: list[str]) -> None:
        if st.state == "admitted":
            why = f"admitted; waiting for {', '.join(st.waits_for)} to stop"
        else:
            why = f"queued: {st.reason_code or 'pending'} {st.reason_message or ''}".strip()
            if st.position is not None:
                why += f" (position {st.position} in team {st.team}'s queue)"
        if not said or said[-1] != why:
            self.log.info("job %s %s", self.job_id, why)
            said[:] = [why]

    def _event(self, status: str, **data: Any) -> TriggerEvent:
        # Everything the operator needs travels in the event: dag.test() resumes the task with
        # the event alone, without the kwargs given to defer().
        return TriggerEvent({"status": status, "job_id": self.job_id, **data})

    async def on_kill(self) -> None:
        """The user killed the waiting task: take the job out of the queue, and stop its
        replicas if this trigger had launched them already."""
        await asyncio.to_thread(release_job, self.job_id, "task killed by a user")


class CompletionTrigger(BaseTrigger):
    """Watch a launched attempt until its gang ends (the runtime enforces the time limit) or
    the store says it is preempted or cancelled, and end the attempt in the store at once.

    Every poll: the runtime's gang status, the replicas' new log lines into the task log (a
    restarted triggerer streams them again from the cursor it was deferred with), and the
    job's state in the store (a cycle elsewhere may have chosen it as a victim:
    `preempting`, or someone cancelled it). Every `heartbeat_s` it heartbeats the store so the
    reaper leaves the attempt alone.

    A poll the runtime cannot answer (RuntimeUnavailable: an API server restarting) is asked
    again at the next tick, the store still heartbeaten: the attempt is neither ended nor lost
    for it, and the replicas run on.

    When the gang ends, the trigger records it (`Store.finish`: succeeded, failed, or lost for
    what Kubernetes says to requeue), which frees the GPUs for the next cycle, and pokes this
    process's cycle poller; a victim's replicas are stopped and the attempt ended as preempted.
    The event says `outcome`: what the store now holds for the attempt (succeeded, failed,
    lost, preempted, cancelled); the operator does the rest (artifacts, MLflow, retry, requeue).
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
        unreachable_since: float | None = None
        while True:
            try:
                gang = await asyncio.to_thread(runtime.poll, launch)
            except RuntimeUnavailable as e:
                # The API server is away (a restart, an upgrade): the replicas run on without
                # it. Keep the attempt alive in the store and ask again; say so once.
                gang = None
                if unreachable_since is None:
                    unreachable_since = time.monotonic()
                    self.log.warning("the runtime cannot tell the gang's state for now: %s", e)
            else:
                if unreachable_since is not None:
                    away = time.monotonic() - unreachable_since
                    self.log.info("the runtime answers again after %.0f s", away)
                    unreachable_since = None
                await self._stream(runtime, launch)
            if gang is not None and gang.state != "running":
                # Kubernetes tells a requeue (eviction, node loss) and a hopeless failure (bad
                # image) from a failed attempt; the local runtime has no such cases.
                disposition = getattr(gang, "disposition", None)
                if gang.state == "succeeded":
                    outcome = await self._end(store, "succeeded", exit_code=0)
                elif disposition == "requeue":
                    outcome = await self._end(store, "lost", message=gang.message or gang.state)
                else:
                    message = gang.message or f"replicas {gang.state}"
                    kw = {"exit_code": gang.exit_code, "message": message}
                    outcome = await self._end(store, "failed", **kw)
                await not_before(started)
                yield self._event(
                    gang.state,
                    outcome=outcome,
                    exit_code=gang.exit_code,
                    rank=gang.failed_rank,
                    reason=gang.reason,
                    message=gang.message,
                    tail=list(gang.log_tail),
                    disposition=disposition,
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
                await asyncio.to_thread(runtime.stop, launch)
                yield self._event("lost", outcome="lost", message=str(e))
                return
            if st.state in ("preempting", "cancelled"):
                try:  # a victim's replicas stop before its GPUs are given back
                    await asyncio.to_thread(runtime.stop, launch)
                except RuntimeUnavailable as e:  # the API server is away: stop again later
                    self.log.warning("the replicas could not be stopped for now: %s", e)
                    await _until_change(runtime, launch, self.poll_s)
                    continue
            if st.state == "preempting":
                outcome = await self._end(store, "preempted", message="preempted by Berth")
                yield self._event("preempted", outcome=outcome, message=st.message or "")
                return
            if st.state == "cancelled":
                yield self._event("cancelled", outcome="cancelled", message=st.message or "")
                return
            await _until_change(runtime, launch, self.poll_s)

    async def _end(self, store: Any, outcome: str, **details: Any) -> str:
        """End the attempt in the store (its GPUs are free for the next cycle) and wake this
        process's waiting jobs; returns the outcome the store holds (someone else, a cancel
        or the reaper, may have ended the attempt first; a failure whose exit code the job
        declares recoverable the store ends as lost)."""
        try:
            st = await asyncio.to_thread(
                store.finish, self.job_id, outcome, attempt=self.attempt, **details
            )
        except StaleAttemptError:  # the reaper ended it and the job moved on
            return "lost"
        except JobStateError:  # ended meanwhile: cancelled, say
            st = await asyncio.to_thread(store.status, self.job_id)
            return st.outcome or st.state
        CyclePoller.poke_running(store)
        return st.outcome or outcome

    def _event(self, status: str, **data: Any) -> TriggerEvent:
        ids = {"job_id": self.job_id, "attempt": self.attempt, "launch": self.launch}
        return TriggerEvent({"status": status, **ids, **data})

    async def _stream(self, runtime: Any, launch: Any) -> None:
        """New replica log lines into the task log (the triggerer routes them there)."""
        from berth.runtime import LogCursor

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


async def _until_change(runtime: Any, launch: Any, timeout_s: float) -> None:
    """Wait up to `timeout_s`, less when the runtime can tell that the gang changed (the
    Kubernetes runtime's watch: a replica's end wakes its trigger at once)."""
    changed = getattr(runtime, "changed", None)
    if changed is None:
        await asyncio.sleep(timeout_s)
    else:
        await changed(launch, timeout_s)
