"""The long-lived scheduling loop (berth/store/loop.py): wake-ups, the lease, failover.

The scenario tests run on SQLite here and on PostgreSQL in tests/test_store_postgres.py.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_workload import LIVE, _step, audit, ceilings, job_id, open_store, spec_for

from berth.store import JobStateError
from berth.store import runner as runner_module
from berth.store.lease import Lease, LeaseLost
from berth.store.loop import SchedulingLoop
from berth.store.mirror import MirrorDiverged
from berth.store.wakeup import listen

HERE = Path(__file__).resolve().parent


@pytest.fixture
def loop_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/berth.db"


def test_a_committed_change_wakes_a_listener_and_a_burst_wakes_it_once(loop_url: str) -> None:
    store = open_store(loop_url)
    listener = listen(store.engine)
    try:
        assert not listener.wait(0.2)  # nothing happened
        store.submit(spec_for(0), job_id=job_id(0))
        assert listener.wait(5.0)
        for i in range(1, 6):  # a burst of five commits
            store.submit(spec_for(i), job_id=job_id(i))
        time.sleep(0.2)  # PostgreSQL delivers its notifications a moment after the commits
        wakes = 0
        while listener.wait(0.5):
            wakes += 1
        assert 1 <= wakes <= 2, wakes  # drained together, not one wake-up per commit
        store.heartbeat(job_id(0))  # no change the engine sees: no wake-up
        assert not listener.wait(0.3)
    finally:
        listener.close()
        store.close()


def test_a_database_path_too_long_for_a_socket_still_wakes_its_listener(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # <db>.wake/<name>.sock > 108 bytes
    deep.mkdir(parents=True)
    store = open_store(f"sqlite:///{deep}/berth.db")
    listener, other = listen(store.engine), listen(store.engine)
    try:
        markers = sorted(os.listdir(f"{deep}/berth.db.wake"))
        assert len(markers) == 2 and all(m.endswith(".abstract") for m in markers), markers
        store.submit(spec_for(0), job_id=job_id(0))
        assert listener.wait(5.0) and other.wait(5.0)
        other.sock.close()  # its process died, the marker stayed: the next commit removes it
        store.submit(spec_for(1), job_id=job_id(1))
        assert listener.wait(5.0)
        assert len(os.listdir(f"{deep}/berth.db.wake")) == 1
    finally:
        listener.close()
        store.close()


@contextlib.contextmanager
def running(loop: SchedulingLoop) -> Iterator[threading.Thread]:
    thread = threading.Thread(target=loop.run, name="loop", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        loop.stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()


def _until(condition, timeout: float = 20.0) -> float:
    """Seconds until `condition()` held; fails at the timeout."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - started


def test_the_loop_admits_a_submission_when_woken_not_by_polling(loop_url: str) -> None:
    store = open_store(loop_url)
    # check_s: the loop would look at the store on its own only after a minute
    loop = SchedulingLoop(open_store(loop_url), check_s=60.0, ttl_s=120.0)
    try:
        with running(loop):
            _until(lambda: loop.stats.cycles >= 1)  # its first cycle, then asleep
            before = loop.stats.cycles
            store.submit(spec_for(0), job_id=job_id(0))
            _until(lambda: store.status(job_id(0)).state == "admitted", timeout=20.0)
            # The loop counts its cycle after the commit that the status above already reads.
            _until(lambda: loop.stats.cycles > before)
            assert loop.stats.cycles == before + 1
            store.heartbeat(job_id(0))  # wakes nobody: nothing the engine sees changed
            time.sleep(0.3)
            assert loop.stats.cycles == before + 1
        assert store.loop_holder() is None  # a clean stop hands the lease back
    finally:
        store.close()


def test_one_loop_leads_the_other_stands_by_and_a_stale_leader_cannot_write(
    loop_url: str,
) -> None:
    store = open_store(loop_url)
    a, b = Lease(store.engine, ttl_s=10.0, holder="a"), Lease(store.engine, ttl_s=10.0, holder="b")
    assert a.claim(now=100.0) and not b.claim(now=105.0)  # held: b stands by
    assert a.claim(now=108.0)  # renewed until 118
    assert not b.claim(now=117.0) and b.claim(now=119.0)  # expired: b takes over
    assert (a.epoch, b.epoch) == (1, 2)
    store.submit(spec_for(0), job_id=job_id(0))
    with pytest.raises(LeaseLost, match="held by b"):
        store.schedule(lease=a)  # a woke up late: it may not commit
    assert store.status(job_id(0)).state == "queued"
    b.claim()  # renewed at the wall clock
    assert store.schedule(lease=b).admitted == (job_id(0),)
    store.close()


def _loop_process(url: str, ttl_s: float, folder: Path) -> subprocess.Popen:
    """A loop process; its log goes to `folder/loop-<n>.log` (a pipe nobody reads would
    block it once full)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    out = (folder / f"loop-{len(list(folder.glob('loop-*.log')))}.log").open("w")
    return subprocess.Popen(
        [sys.executable, str(HERE / "loop_process.py"), url, str(ttl_s), str(folder)],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def _logs(folder: Path) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("*.log")))


# The leader renewed its 3 s lease at most 1 s (ttl / 3) before it was killed; a standby tries
# to claim every 1 s: it holds the lease at most 3 + 1 s after the kill. 1 s more for a busy
# machine (the loop processes share two cores with the test and the database).
TAKEOVER_BOUND_S = 3.0 + 1.0 + 1.0


def check_failover(url: str, folder: Path, jobs: int = 40, ttl_s: float = 3.0) -> float:
    """Two loop processes; the leader is killed inside a cycle's commit, holding the lock; the
    standby takes over; workers (here) start and end jobs until all have succeeded. Returns
    how long the takeover took after the kill."""
    store = open_store(url)
    lease = Lease(store.engine)
    first = _loop_process(url, ttl_s, folder)
    procs = [first]
    rng = random.Random(3)
    try:
        _until(lambda: lease.holder_now() == f"loop-{first.pid}")
        second = _loop_process(url, ttl_s, folder)
        procs.append(second)

        def work() -> None:
            for st in store.jobs(states=LIVE):
                with contextlib.suppress(JobStateError):
                    _step(store, st.id, st.state, st.attempt, rng)

        for i in range(jobs // 2):
            store.submit(spec_for(i), job_id=job_id(i))
        _until(lambda: any(s.state != "queued" for s in store.jobs()))
        for _ in range(20):
            work()
        (folder / f"slow-{first.pid}").write_text("")
        # Wakes the leader: its next cycle stops in the commit, holding the store's lock. In
        # a thread: a cycle already under way may stop there first, and the submission then
        # waits for the lock until the leader is killed.
        waking = threading.Thread(
            target=store.submit, args=(spec_for(jobs // 2),), kwargs={"job_id": job_id(jobs // 2)}
        )
        waking.start()
        _until(lambda: (folder / f"in-commit-{first.pid}").exists())
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        killed = time.monotonic()
        waking.join(timeout=60)  # it commits once the dead leader's lock is gone
        for i in range(jobs // 2 + 1, jobs):
            store.submit(spec_for(i), job_id=job_id(i))
        _until(lambda: lease.holder_now() == f"loop-{second.pid}", timeout=ttl_s + 10)
        takeover = time.monotonic() - killed
        deadline = time.monotonic() + 180
        while store.jobs(states=LIVE):
            assert time.monotonic() < deadline, _logs(folder)
            work()
            time.sleep(0.02)
        final = store.jobs()
        assert len(final) == jobs and {s.state for s in final} == {"succeeded"}  # nothing lost
        kinds = audit(store.events(), ceilings())  # no GPU ever given twice, quotas held
        assert kinds["admit"] == jobs + kinds["requeue"] + kinds["lost"]
        return takeover
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(timeout=30)
        store.close()


def test_a_standby_loop_takes_over_when_the_leader_dies_mid_cycle_sqlite(
    loop_url: str, tmp_path: Path
) -> None:
    takeover = check_failover(loop_url, tmp_path)
    print(f"standby took over {takeover:.2f} s after the kill")
    assert takeover <= TAKEOVER_BOUND_S


def test_the_loop_checks_its_state_against_a_rebuild_as_it_goes(loop_url: str) -> None:
    store = open_store(loop_url)
    loop = SchedulingLoop(open_store(loop_url), check_s=0.05, self_check_every_s=0.0)
    try:
        with running(loop):
            # Three bursts, a cycle after each: a burst may be decided in one cycle, and the
            # loop's own commits run none, so twelve submissions at once could make only one.
            for burst in range(3):
                cycles = loop.stats.cycles
                for i in range(4 * burst, 4 * burst + 4):
                    store.submit(spec_for(i), job_id=job_id(i))
                _until(lambda cycles=cycles: loop.stats.cycles > cycles)
            _until(lambda: loop.stats.self_checks >= 3)
            for st in store.jobs(states=["admitted"]):
                if store.launchable(st.id):
                    store.mark_started(st.id, st.attempt)
            for st in store.jobs(states=["running"])[:3]:
                store.finish(st.id, "succeeded", attempt=st.attempt)
            checks = loop.stats.self_checks
            _until(lambda: loop.stats.self_checks >= checks + 3)
        assert loop.stats.errors == 0
    finally:
        store.close()


def test_a_change_committed_while_a_cycle_decides_is_not_lost(
    loop_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission committed after a cycle decided but before it committed is taken into the
    mirror by that commit, unseen by its decisions: `changed()` must still be True, or a
    loop would sleep with the job queued and never looked at (found by the ETA test). Also
    after a self-check, which catches the mirror up without deciding."""
    leader, other = open_store(loop_url), open_store(loop_url)
    try:
        leader.schedule()  # the mirror exists
        real = runner_module.explain
        calls = []

        def explain_then_submit(mirror, result):  # between the decision and the commit
            if not calls:
                calls.append(1)
                other.submit(spec_for(0), job_id=job_id(0))
            return real(mirror, result)

        monkeypatch.setattr(runner_module, "explain", explain_then_submit)
        leader.schedule()
        assert calls and other.status(job_id(0)).reason_code is None  # not decided on
        assert leader.changed()
        leader.schedule()
        assert not leader.changed() and other.status(job_id(0)).state == "admitted"

        other.submit(spec_for(1), job_id=job_id(1))
        leader.self_check()  # catches the mirror up to the submission
        assert leader.changed()
    finally:
        leader.close()
        other.close()


def test_the_loop_estimates_the_waiting_jobs_starts(loop_url: str) -> None:
    """ETAs are written after cycles (and only then: a quiet store is not estimated again
    before ETA_STALE_S), outside the store's versions, so they wake no cycle."""
    store = open_store(loop_url)
    loop = SchedulingLoop(open_store(loop_url), check_s=0.05, eta_every_s=0.01)
    try:
        n = 0
        with running(loop):
            while True:  # until one waits after a cycle looked at it: the cluster is full
                store.submit(spec_for(n), job_id=job_id(n))
                _until(
                    lambda n=n: (
                        store.status(job_id(n)).reason_code is not None
                        or store.status(job_id(n)).state != "queued"
                    )
                )
                n += 1
                waiting = [s.id for s in store.jobs(states=["queued"]) if s.reason_code]
                if waiting:
                    break
            _until(lambda: set(store.etas(waiting)) == set(waiting), timeout=20.0)
            cycles = loop.stats.cycles
            time.sleep(0.5)
            assert loop.stats.cycles == cycles  # writing ETAs woke no cycle
        for job, eta in store.etas(waiting).items():
            assert eta.at >= eta.computed_at and eta.basis in ("limits", "estimate"), (job, eta)
        assert loop.stats.errors == 0 and loop.stats.etas >= len(waiting)
    finally:
        store.close()


def test_a_loop_whose_state_drifted_stops_with_the_difference(loop_url: str) -> None:
    store = open_store(loop_url)
    loop = SchedulingLoop(open_store(loop_url), check_s=0.05, self_check_every_s=3600.0)
    try:
        store.submit(spec_for(0), job_id=job_id(0))
        loop.run(max_cycles=1)  # leads, decides, hands the lease back
        loop.store.runner.mirror.state.capacity.free_cpu[0] -= 1000  # a bug that leaks a CPU
        loop.self_check_every_s = 0.0
        loop.stop.clear()
        with pytest.raises(MirrorDiverged, match="free"):
            loop.run()
    finally:
        store.close()


def test_the_loop_exports_its_cycles_and_leadership_to_prometheus(loop_url: str) -> None:
    """`berth scheduler --metrics-port`: each committed cycle's duration and decisions, and
    whether this process leads, scraped over HTTP as Prometheus would."""
    import httpx
    from ports import free_port
    from prometheus_client.parser import text_string_to_metric_families

    from berth.loop_metrics import LoopMetrics

    metrics = LoopMetrics()
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")

    def scrape() -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
                if "le" not in s.labels:
                    out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    assert scrape()["berth_scheduling_loop_leader"] == 0
    store = open_store(loop_url)
    loop = SchedulingLoop(
        open_store(loop_url), check_s=0.05, on_cycle=metrics.on_cycle, on_lead=metrics.on_lead
    )
    try:
        with running(loop):
            for n in range(3):
                store.submit(spec_for(n), job_id=job_id(n))
            _until(lambda: all(store.status(job_id(n)).state != "queued" for n in range(3)))
            _until(lambda: scrape().get("berth_admission_cycle_duration_seconds_count", 0) > 0)
            got = scrape()
            assert got["berth_scheduling_loop_leader"] == 1
            assert got["berth_admission_cycle_duration_seconds_count"] == loop.stats.cycles
            assert 0 < got["berth_admission_cycle_duration_seconds_sum"] < 60
            admitted = sum(1 for n in range(3) if store.status(job_id(n)).attempt >= 1)
            assert got["berth_admission_cycle_decisions_total{decision=admitted}"] == admitted
        assert scrape()["berth_scheduling_loop_leader"] == 0  # stopped: the lease handed back
    finally:
        store.close()
