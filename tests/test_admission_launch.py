"""Admission and launch without a worker: the cycle poller and the run task's triggers,
driven in an asyncio loop as the triggerer drives them, against a real SQLite store and the
real local runtime (real replica processes). Airflow's scheduler is not involved: what is
checked is that freed GPUs reach the next job through the triggers alone.

`poll_s` is an hour in these tests, so nothing here can be woken by the safety-net poll: a
waiter that wakes was woken by the store's change token or by a poke.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from waiting import wait_for

from berth.runtime import RuntimeUnavailable
from berth.settings import settings
from berth.spec import parse_spec
from berth.store import JobStatus, Store
from berth.store.poller import CyclePoller
from operators import triggers
from operators.launching import LaunchPlan, launch_attempt
from operators.tracking import TaskRef

HOUR = 3600.0
TASK = TaskRef("d", "r1", "g.run", 1)


def _spec(name: str, replicas: int, gpus: int, seconds: float) -> dict[str, Any]:
    return parse_spec(
        {
            "name": name,
            "team": "vision",
            "image": "python:3.11",  # the local runtime runs it in the platform's interpreter
            "command": [sys.executable, "-c", f"import time; time.sleep({seconds})"],
            "replicas": replicas,
            "gpus_per_replica": gpus,
            "cpus_per_replica": 1,
            "memory_gb_per_replica": 1,
        }
    ).model_dump(mode="json")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """The settings the triggers read (BERTH_HOME in a temp folder, the repo's 2 x 4-GPU
    cluster and teams); the same Store object the triggers get from settings()."""
    monkeypatch.setenv("BERTH_HOME", str(tmp_path / "berth"))
    monkeypatch.delenv("BERTH_STORE_URL", raising=False)
    monkeypatch.delenv("BERTH_RUNTIME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # The hold against Airflow's deferral race (apache/airflow#72716) has no Airflow to race here.
    monkeypatch.setattr(triggers, "MIN_EVENT_AGE_S", 0.0)
    s = settings().store()
    yield s
    runtime = settings().runtime()
    for job in s.jobs():  # cancelled in the store too: no completion trigger stopped those
        launch = runtime.reattach(job.id, job.attempt) if job.attempt else None
        if launch is not None:
            runtime.stop(launch, grace_s=1)


def _submit(store: Store, name: str, replicas: int, gpus: int, seconds: float) -> LaunchPlan:
    spec = _spec(name, replicas, gpus, seconds)
    store.submit(parse_spec(spec), job_id=name)
    return LaunchPlan(spec, {}, TASK)


def _run_now(store: Store, name: str, plan: LaunchPlan) -> dict[str, Any]:
    """What the run task's first cycle does when the cluster has room."""
    store.schedule()
    st = store.status(name)
    assert st.state == "admitted", st
    return launch_attempt(plan, name, st.attempt).launch


async def _first_event(trigger: Any) -> dict[str, Any]:
    async for event in trigger.run():
        return dict(event.payload)
    raise AssertionError("the trigger ended without an event")


def test_freed_gpus_start_the_waiting_job_from_the_triggers_alone(store: Store) -> None:
    big = _submit(store, "big", 2, 4, 1.0)  # all 8 GPUs, for about a second
    launch = _run_now(store, "big", big)
    waiting = _submit(store, "next", 1, 4, 0.2)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        admission = triggers.AdmissionTrigger("next", waiting.to_dict(), poll_s=HOUR)
        completion = triggers.CompletionTrigger("big", 1, launch, poll_s=0.1, heartbeat_s=HOUR)
        return await asyncio.gather(_first_event(completion), _first_event(admission))

    ended, started = asyncio.run(asyncio.wait_for(scenario(), 60))

    assert (ended["status"], ended["outcome"]) == ("succeeded", "succeeded")
    assert started["status"] == "running" and started["attempt"] == 1
    assert started["launch"]["job_id"] == "next"
    # The store's history: the big job ended (by the completion trigger, not by a task), then
    # the waiting job was admitted onto the freed GPUs and started by its admission trigger.
    kinds = [(e.job_id, e.type) for e in store.events() if e.type in ("finish", "admit", "start")]
    assert kinds == [
        ("big", "admit"),
        ("big", "start"),
        ("big", "finish"),
        ("next", "admit"),
        ("next", "start"),
    ]
    assert (store.status("big").state, store.status("big").exit_code) == ("succeeded", 0)
    # The replicas really run: the runtime sees the waiting job's gang, and it ends well.
    runtime = settings().runtime()
    handle = runtime.launch_from_dict(started["launch"])
    wait_for(lambda: runtime.poll(handle).state != "running", "the waiting job's gang to end")
    assert runtime.poll(handle).state == "succeeded"


def test_a_job_still_waiting_at_notify_at_fires_waiting_with_its_plan(store: Store) -> None:
    """The "waiting too long" notification: the trigger of a job that cannot be admitted
    fires `waiting` at notify_at (carrying its plan, so the task can notify and wait on), and
    leaves the job queued; without notify_at it keeps waiting."""
    holder = _submit(store, "holder", 2, 4, HOUR)  # all 8 GPUs for an hour
    _run_now(store, "holder", holder)
    plan = _submit(store, "patient", 1, 4, 0.1)
    at = time.time() + 0.5
    started = time.monotonic()
    trigger = triggers.AdmissionTrigger("patient", plan.to_dict(), poll_s=HOUR, notify_at=at)
    event = asyncio.run(asyncio.wait_for(_first_event(trigger), 30))
    assert time.monotonic() - started >= 0.4
    assert (event["status"], event["job_id"]) == ("waiting", "patient")
    assert LaunchPlan.from_dict(event["plan"]) == plan
    assert store.status("patient").state == "queued"
    untold = triggers.AdmissionTrigger("patient", plan.to_dict(), poll_s=HOUR)
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(_first_event(untold), 1.0))
    assert store.status("patient").state == "queued"


def test_one_cycle_serves_every_waiting_job(store: Store) -> None:
    holder = _submit(store, "holder", 2, 4, HOUR)
    _run_now(store, "holder", holder)
    for i in range(5):
        _submit(store, f"w{i}", 1, 1, 0.1)

    async def scenario() -> tuple[int, int, list[JobStatus]]:
        poller = CyclePoller.of(store)
        seen: dict[str, int] = {}

        def note(st: JobStatus) -> None:
            seen[st.id] = seen.get(st.id, 0) + 1

        waits = [
            asyncio.create_task(poller.wait(f"w{i}", poll_s=HOUR, on_queued=note)) for i in range(5)
        ]
        # Every waiter has heard its queued status from a cycle: then the token stays still.
        while len(seen) < 5:
            await asyncio.sleep(0.05)
        settled = poller.cycles
        for _ in range(3):  # three ticks, nothing changes in the store
            await asyncio.sleep(poller.tick_s)
        idle = poller.cycles - settled
        # Someone in another process cancels the holder: the token moves, a cycle follows.
        await asyncio.to_thread(store.cancel, "holder", message="test")
        done = await asyncio.gather(*waits)
        return settled, idle, done

    settled, idle, done = asyncio.run(asyncio.wait_for(scenario(), 60))
    # Five waiters, yet a handful of cycles in all (one per change, plus the one after each
    # admission), and none while nothing changed.
    assert settled <= 3, settled
    assert idle == 0
    assert [st.state for st in done] == ["admitted"] * 5
    assert {st.id for st in done} == {f"w{i}" for i in range(5)}


def test_a_change_committed_elsewhere_wakes_the_poller_before_its_tick(store: Store) -> None:
    holder = _submit(store, "holder", 2, 4, HOUR)
    _run_now(store, "holder", holder)
    _submit(store, "waiting", 1, 1, 0.1)

    async def scenario() -> JobStatus:
        poller = CyclePoller.of(store)
        poller.tick_s = 60.0  # it would look at the store on its own only after a minute
        heard = asyncio.Event()
        waiting = asyncio.create_task(
            poller.wait("waiting", poll_s=HOUR, on_queued=lambda st: heard.set())
        )
        await heard.wait()  # its first cycle: queued behind the holder
        await asyncio.sleep(0.5)  # the poller is asleep now
        await asyncio.to_thread(store.cancel, "holder", message="test")  # as another process
        return await asyncio.wait_for(waiting, 20)  # woken by the commit, not by its tick

    assert asyncio.run(asyncio.wait_for(scenario(), 60)).state == "admitted"


def test_waiting_for_an_unknown_job_is_an_error_not_a_hang(store: Store) -> None:
    async def scenario() -> list[BaseException | JobStatus]:
        poller = CyclePoller.of(store)
        waits = [poller.wait(name, poll_s=HOUR) for name in ("nobody", "neither")]
        return await asyncio.gather(*waits, return_exceptions=True)

    got = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert all("never submitted" in str(e) for e in got), got


def test_a_launch_that_fails_ends_the_attempt_as_failed(store: Store) -> None:
    plan = _submit(store, "doomed", 1, 1, 0.1)
    # What the local runtime refuses: an attempt folder that exists already (a launch before).
    runtime = settings().runtime()
    runtime.attempt_dir("doomed", 1).mkdir(parents=True)

    async def scenario() -> dict[str, Any]:
        return await _first_event(triggers.AdmissionTrigger("doomed", plan.to_dict(), poll_s=HOUR))

    event = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert (event["status"], event["attempt"]) == ("launch_failed", 1)
    assert "was launched before" in event["message"]
    st = store.status("doomed")
    assert (st.state, st.attempt) == ("failed", 1)
    assert st.message.startswith("launch failed")
    assert store.usage()["vision"].gpus == 0  # nothing held


def test_each_waiter_hears_its_status_in_its_own_context(store: Store) -> None:
    """Airflow's triggerer routes a trigger's log records by context variables bound in the
    trigger's task (structlog's `trigger_id`, as `run_trigger` binds it). The poller's cycle
    runs in one task for every waiter: each waiter's "why it waits" must still be said in its
    own context, or it lands in another job's task log."""
    holder = _submit(store, "holder", 2, 4, HOUR)
    _run_now(store, "holder", holder)
    for i in range(3):
        _submit(store, f"w{i}", 1, 1, 0.1)
    heard: dict[str, set[Any]] = {}

    async def one_trigger(trigger_id: int, job_id: str) -> JobStatus:
        structlog.contextvars.bind_contextvars(trigger_id=trigger_id)  # as the triggerer does

        def say(st: JobStatus) -> None:
            where = structlog.contextvars.get_contextvars().get("trigger_id")
            heard.setdefault(st.id, set()).add(where)

        return await CyclePoller.of(store).wait(job_id, poll_s=HOUR, on_queued=say)

    async def scenario() -> list[JobStatus]:
        waits = [asyncio.create_task(one_trigger(100 + i, f"w{i}")) for i in range(3)]
        while len(heard) < 3:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(store.cancel, "holder", message="test")
        return await asyncio.gather(*waits)

    done = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [st.state for st in done] == ["admitted"] * 3
    assert heard == {f"w{i}": {100 + i} for i in range(3)}


class _Said:
    """A stand-in for a trigger's logger: what it said, formatted."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args)

    warning = info


def test_a_waiting_jobs_trigger_says_why_where_it_stands_and_when_it_may_start(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the job waits, its own trigger's log (the wait task's log) says its reason, its
    place in its team's queue and its expected start; then that it started."""
    monkeypatch.setattr(triggers, "ETA_EVERY_S", 0.05)
    holder = _submit(store, "holder", 2, 4, HOUR)
    _run_now(store, "holder", holder)  # all 8 GPUs
    plan = _submit(store, "patient", 1, 4, 0.1)
    assert store.estimate_starts() == 1
    eta = store.etas(["patient"])["patient"]
    trigger = triggers.AdmissionTrigger("patient", plan.to_dict(), poll_s=HOUR)
    said = _Said()
    trigger._log = said  # LoggingMixin keeps its logger here

    async def scenario() -> dict[str, Any]:
        first = asyncio.create_task(_first_event(trigger))
        await asyncio.sleep(0.5)
        assert not first.done()
        await asyncio.to_thread(store.cancel, "holder", message="test")
        return await first

    event = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert (event["status"], event["attempt"]) == ("running", 1)
    at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(eta.at))
    basis = "at the latest, from time limits" if eta.basis == "limits" else "estimate"
    assert f"job patient expected to start {at} UTC ({basis})" in said.lines, said.lines
    reasons = [line for line in said.lines if line.startswith("job patient queued: ")]
    assert reasons and "(position 1 in team vision's queue)" in reasons[0], said.lines
    assert said.lines[-1] == "job patient attempt 1 started"
    # Said once each: a line is repeated only when what it says changes.
    assert len(reasons) == len(set(reasons)) and len(said.lines) == len(set(said.lines))


def test_a_runtime_that_cannot_answer_for_a_while_loses_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime cannot tell the gang's state for its first polls (RuntimeUnavailable, as
    from an API server that restarts): the completion trigger keeps the attempt alive in the
    store and asks again, and ends it as it really ended."""
    plan = _submit(store, "steady", 1, 4, 0.5)
    launch = _run_now(store, "steady", plan)
    runtime = settings().runtime()
    real, calls = runtime.poll, []

    def unavailable_at_first(handle: Any) -> Any:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise RuntimeUnavailable("the API server cannot be reached: connection refused")
        return real(handle)

    monkeypatch.setattr(runtime, "poll", unavailable_at_first)
    trigger = triggers.CompletionTrigger("steady", 1, launch, poll_s=0.1, heartbeat_s=0.1)
    event = asyncio.run(asyncio.wait_for(_first_event(trigger), 60))
    assert (event["status"], event["outcome"]) == ("succeeded", "succeeded")
    assert len(calls) > 3 and store.status("steady").state == "succeeded"


def test_replicas_that_cannot_be_stopped_for_now_are_stopped_later(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled job's trigger stops its replicas; the runtime cannot for its first two tries
    (RuntimeUnavailable): the trigger tries again at its next ticks, and fires `cancelled`
    only once they are stopped."""
    plan = _submit(store, "stubborn", 1, 4, HOUR)
    launch = _run_now(store, "stubborn", plan)
    runtime = settings().runtime()
    real, tries = runtime.stop, []

    def unavailable_at_first(handle: Any, *args: Any, **kwargs: Any) -> None:
        tries.append(time.monotonic())
        if len(tries) <= 2:
            raise RuntimeUnavailable("the attempt could not be stopped for now: refused")
        real(handle, *args, **kwargs)

    monkeypatch.setattr(runtime, "stop", unavailable_at_first)
    store.cancel("stubborn", message="by a test")
    trigger = triggers.CompletionTrigger("stubborn", 1, launch, poll_s=0.1, heartbeat_s=HOUR)
    event = asyncio.run(asyncio.wait_for(_first_event(trigger), 60))
    assert event["status"] == "cancelled" and len(tries) == 3
    handle = runtime.launch_from_dict(launch)
    wait_for(lambda: runtime.poll(handle).state != "running", "the replicas to be stopped")
