"""One launcher per admitted attempt (berth/store/launch_claim.py), however many triggerers
share the store: the claim's rules on a virtual clock, two launchers racing for one attempt
with the real local runtime (one launches, the other waits; one gang), and a trigger that
finds a dead launcher's claim and launches once it lapses."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_for

from berth.settings import BerthSettings, settings
from berth.spec import parse_spec
from berth.store import JobStateError, StaleAttemptError, Store
from berth.store.launch_claim import held_launch
from operators import triggers
from operators.launching import LaunchBusy, Launched, LaunchPlan, launch_attempt
from operators.tracking import TaskRef

LEASE_S = 30.0


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """The settings the launchers read: BERTH_HOME in a temp folder, the repo's 2 x 4-GPU
    cluster and teams, the local runtime, a 1 s launch lease."""
    monkeypatch.setenv("BERTH_HOME", str(tmp_path / "berth"))
    monkeypatch.setenv("BERTH_LAUNCH_LEASE_S", "1")
    for name in ("BERTH_STORE_URL", "BERTH_RUNTIME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(triggers, "MIN_EVENT_AGE_S", 0.0)  # no Airflow to race here
    s = settings().store()
    yield s
    runtime = settings().runtime()
    for job in s.jobs():
        launch = runtime.reattach(job.id, job.attempt) if job.attempt else None
        if launch is not None:
            runtime.stop(launch, grace_s=1)


def _submit(store: Store, name: str, seconds: float = 0.5) -> LaunchPlan:
    fields = {
        "name": name, "team": "vision", "image": "python:3.11",
        "command": [sys.executable, "-c", f"import time; time.sleep({seconds})"],
        "replicas": 2, "gpus_per_replica": 2, "cpus_per_replica": 1, "memory_gb_per_replica": 1,
    }  # fmt: skip
    spec = parse_spec(fields)
    store.submit(spec, job_id=name)
    return LaunchPlan(spec.model_dump(mode="json"), {}, TaskRef("d", "r1", "g.run", 1))


def test_a_claim_is_one_launchers_until_it_lapses_and_ends_with_the_attempt(store: Store) -> None:
    _submit(store, "j")
    store.schedule(now=100.0)
    assert store.claim_launch("j", 1, "a", lease_s=LEASE_S, now=100.0) is None
    assert store.claim_launch("j", 1, "b", lease_s=LEASE_S, now=110.0) == "a"
    assert store.claim_launch("j", 1, "a", lease_s=LEASE_S, now=125.0) is None  # renewed
    assert store.claim_launch("j", 1, "b", lease_s=LEASE_S, now=150.0) == "a"  # 25 s since
    assert store.claim_launch("j", 1, "b", lease_s=LEASE_S, now=155.0) is None  # lapsed: b's
    assert store.claim_launch("j", 1, "a", lease_s=LEASE_S, now=156.0) == "b"  # a was too slow
    with pytest.raises(StaleAttemptError):
        store.claim_launch("j", 2, "b", lease_s=LEASE_S, now=156.0)
    store.finish("j", "lost", message="launcher died", attempt=1, now=157.0)
    with pytest.raises(JobStateError, match="claim_launch needs it admitted"):
        store.claim_launch("j", 1, "b", lease_s=LEASE_S, now=158.0)
    store.schedule(now=158.0)  # attempt 2: nobody's, whoever claimed attempt 1
    assert store.claim_launch("j", 2, "c", lease_s=LEASE_S, now=158.0) is None
    store.mark_started("j", 2, now=159.0)
    with pytest.raises(JobStateError, match="is running"):
        store.claim_launch("j", 2, "c", lease_s=LEASE_S, now=160.0)


def test_two_launchers_of_one_attempt_start_one_gang(store: Store) -> None:
    """Two triggerers running the same admission trigger at once (Airflow's failover overlap)
    launch the admitted attempt together: one launches, the other is told to wait; one gang
    runs and the job ends once. (Without the claim the second reaches the runtime too, which
    refuses an attempt launched before: the attempt ends as failed, or both think they
    launched it.)"""
    plan = _submit(store, "twice")
    store.schedule()
    start = threading.Barrier(2)
    got: list[Launched | BaseException] = []

    def launcher() -> None:
        start.wait()
        try:
            got.append(launch_attempt(plan, "twice", 1))
        except BaseException as e:  # the test reads what each launcher saw
            got.append(e)

    threads = [threading.Thread(target=launcher) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    launched = [g for g in got if isinstance(g, Launched)]
    busy = [g for g in got if isinstance(g, LaunchBusy)]
    assert (len(launched), len(busy)) == (1, 1), got
    assert "is launching it" in str(busy[0]) or "is running" in str(busy[0])
    runtime = settings().runtime()
    launch = runtime.launch_from_dict(launched[0].launch)
    assert len(launch.replicas) == 2
    status = wait_for(lambda: (s := runtime.poll(launch)).state != "running" and s, "the end", 30)
    assert status.state == "succeeded", status
    store.finish("twice", "succeeded", exit_code=0, attempt=1)
    assert [e.type for e in store.events("twice")] == ["submit", "admit", "start", "finish"]


def test_a_trigger_launches_once_a_dead_launchers_claim_lapses(store: Store) -> None:
    """A launcher claimed the attempt and died (its triggerer killed) before creating anything.
    The trigger that takes over waits while the claim is fresh, then launches (within the
    lease and one poll), and the job runs to its end."""
    plan = _submit(store, "orphan", seconds=0.1)
    store.schedule()
    assert store.claim_launch("orphan", 1, "dead-triggerer/1/x", lease_s=1.0) is None
    claimed_at = time.monotonic()

    async def scenario() -> dict[str, Any]:
        trigger = triggers.AdmissionTrigger("orphan", plan.to_dict(), poll_s=0.2)
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    event = asyncio.run(asyncio.wait_for(scenario(), 30))
    waited = time.monotonic() - claimed_at
    assert (event["status"], event["attempt"]) == ("running", 1), event
    assert 0.9 <= waited < 5.0, waited  # the lease (1 s), then the next look
    st = store.status("orphan")
    assert st.state == "running"


def test_a_launch_that_hangs_stops_renewing_its_claim(store: Store) -> None:
    """A launcher stuck inside its launch (a request that never returns) renews its claim
    for `max_hold_s` only; then the claim lapses and another launcher may take the job over.
    One that finishes in time keeps the claim to the end."""
    _submit(store, "stuck")
    store.schedule()
    with held_launch(store, "stuck", 1, lease_s=1.0, max_hold_s=2.5) as holder:
        assert store.claim_launch("stuck", 1, "other", lease_s=1.0) == holder
        time.sleep(1.5)  # the launch itself, working past one lease: renewed meanwhile
        assert store.claim_launch("stuck", 1, "other", lease_s=1.0) == holder
        wait_for(
            lambda: store.claim_launch("stuck", 1, "other", lease_s=1.0) is None,
            "the stuck launcher's claim to lapse",
            timeout=10,
            every=0.1,
        )


def test_the_launch_lease_is_checked_when_the_settings_are_read(tmp_path: Path) -> None:
    env = {"BERTH_HOME": str(tmp_path)}
    assert BerthSettings.from_env(env).launch_lease_s == 60.0
    assert BerthSettings.from_env(env | {"BERTH_LAUNCH_LEASE_S": "5"}).launch_lease_s == 5.0
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ValueError, match="BERTH_LAUNCH_LEASE_S: must be a number"):
            BerthSettings.from_env(env | {"BERTH_LAUNCH_LEASE_S": bad})
