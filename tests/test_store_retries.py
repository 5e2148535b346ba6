"""The store when attempts go wrong: a silent worker reaped, a job lost again and again, exit
codes a job declares recoverable, a preempting job that goes silent, failed attempts retried
with their backoff. Scenarios of test_store.py's kind, on its fixtures and helpers;
test_store_postgres.py runs them again on PostgreSQL."""

from __future__ import annotations

import pytest
from test_store import make_store, run, store_url, submit  # noqa: F401 (fixtures)

from berth.store import JobStateError, StaleAttemptError, Store, lifecycle


@pytest.fixture
def store(make_store) -> Store:  # noqa: F811 (a fixture takes the one imported by name)
    return make_store()


def test_reap_requeues_a_silent_job_and_refuses_its_old_worker(store: Store) -> None:
    submit(store, "a1", 0, gpus=2)
    store.schedule(now=1)
    run(store, "a1", 2)
    store.heartbeat("a1", attempt=1, now=100)
    assert store.reap(now=150, lease_s=60) == []
    assert store.reap(now=161, lease_s=60) == ["a1"]
    lost = store.status("a1")
    assert (lost.state, lost.attempt, lost.outcome, lost.preemptions) == ("queued", 1, "lost", 0)
    assert store.usage()["a"].gpus == 0
    store.schedule(now=162)
    with pytest.raises(StaleAttemptError):
        store.heartbeat("a1", attempt=1, now=163)  # the old worker wakes up
    assert store.status("a1").state == "admitted" and store.status("a1").attempt == 2
    with pytest.raises(StaleAttemptError):
        store.finish("a1", "succeeded", attempt=1, now=164)
    lost_events = [e for e in store.events("a1") if e.type == "lost"]
    assert lost_events[0].data["by"] == "reap" and lost_events[0].data["attempt"] == 1


def test_a_job_lost_again_and_again_backs_off_instead_of_looping(store: Store) -> None:
    """A GPU another workload holds, a node that keeps failing: each launch is lost at once.
    The first loss requeues at once (run elsewhere); then the waits double, as Kueue's after
    repeated evictions, so the job does not relaunch in a tight loop."""
    submit(store, "a1", 0, gpus=2)
    now, waits = 1.0, []
    for _ in range(5):
        store.schedule(now=now)
        st = store.status("a1")
        assert st.state == "admitted", st
        run(store, "a1", now)
        store.finish("a1", "lost", attempt=st.attempt, message="gpu held", now=now)
        waits.append(max(0.0, store.status("a1").not_before - now))
        if waits[-1]:
            store.schedule(now=now + waits[-1] / 2)
            st = store.status("a1")
            assert (st.state, st.reason_code) == ("queued", "backoff")
        now += waits[-1] + 0.1
    assert waits == [0.0, 10.0, 20.0, 40.0, 80.0]
    # An attempt that ends otherwise starts the count again.
    store.schedule(now=now)
    run(store, "a1", now)
    store.finish("a1", "preempted", attempt=store.status("a1").attempt, now=now)
    assert store.status("a1").not_before <= now
    store.schedule(now=now + 0.1)
    run(store, "a1", now + 0.1)
    store.finish("a1", "lost", attempt=store.status("a1").attempt, now=now + 0.2)
    assert store.status("a1").not_before <= now + 0.2


def test_an_exit_code_the_job_declares_recoverable_requeues_it_without_a_retry(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 75 is recoverable for this job: the attempt ends as lost (back at its place in the
    queue, no retry used) and says why, up to MAX_RECOVERIES times; then, and for any other
    code, the job fails as before (its retries are the operator's to use)."""
    monkeypatch.setattr(lifecycle, "MAX_RECOVERIES", 2)
    submit(store, "a1", 0, gpus=2, recoverable_exit_codes=[75, -9])
    now = 1.0
    for used in (1, 2):
        store.schedule(now=now)
        run(store, "a1", now)
        st = store.finish("a1", "failed", attempt=used, exit_code=75, message="NCCL", now=now)
        assert (st.state, st.outcome, st.exit_code) == ("queued", "lost", 75)
        assert "recoverable_exit_codes" in (st.message or "")
        assert f"recovery {used} of at most 2" in (st.message or "") and "NCCL" in st.message
        now = max(now, st.not_before) + 1.0
    kinds = [e.type for e in store.events("a1")]
    assert kinds.count("lost") == 2 and "fail" not in kinds
    store.schedule(now=now)
    run(store, "a1", now)
    st = store.finish("a1", "failed", attempt=3, exit_code=75, message="NCCL", now=now)
    assert (st.state, st.outcome) == ("failed", "failed")
    assert "recovered 2 times (at most 2): this failure uses a retry" in (st.message or "")
    # Another code is a failure at once.
    submit(store, "a2", now, gpus=2, recoverable_exit_codes=[75])
    store.schedule(now=now + 1)
    run(store, "a2", now + 1)
    st = store.finish("a2", "failed", attempt=1, exit_code=3, message="bug", now=now + 2)
    assert (st.state, st.outcome, st.message) == ("failed", "failed", "bug")


def test_a_preempting_job_silent_past_the_lease_counts_as_stopped(store: Store) -> None:
    submit(store, "a1", 0, gpus=4)
    submit(store, "a2", 1, gpus=4, priority=-1)  # the cheaper loss
    store.schedule(now=2)
    run(store, "a1", 3)
    run(store, "a2", 4)
    store.heartbeat("a1", now=500)
    submit(store, "b1", 5, team="b", gpus=4)
    store.schedule(now=6)
    store.heartbeat("b1", now=500)  # its worker polls launchable() and stays alive meanwhile
    assert store.reap(now=600, lease_s=300) == ["a2"]  # its worker died while stopping
    assert store.status("a2").preemptions == 1 and store.launchable("b1")


def test_failed_attempt_is_retried_as_a_new_attempt(store: Store) -> None:
    submit(store, "a1", 0, gpus=1)
    store.schedule(now=1)
    run(store, "a1", 2)
    failed = store.finish("a1", "failed", exit_code=3, message="CUDA OOM", now=3)
    assert (failed.state, failed.exit_code, failed.message) == ("failed", 3, "CUDA OOM")
    queued = store.retry("a1", now=4)
    assert (queued.state, queued.attempt, queued.not_before) == ("queued", 1, 0)
    with pytest.raises(JobStateError, match="retry needs it failed"):
        store.retry("a1", now=4)
    assert store.schedule(now=5).admitted == ("a1",)
    assert store.status("a1").attempt == 2


def test_retry_honours_its_backoff(store: Store) -> None:
    submit(store, "a1", 0, gpus=1)
    store.schedule(now=1)
    store.finish("a1", "failed", exit_code=1, now=2)  # failed at launch, never started
    store.retry("a1", not_before=100, now=3)
    assert store.schedule(now=50).admitted == ()
    assert store.status("a1").reason_code == "backoff"
    assert store.schedule(now=100).admitted == ("a1",)
