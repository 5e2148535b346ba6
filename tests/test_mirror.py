"""The scheduling state a Store keeps in memory between cycles (berth/store/mirror.py).

It must never differ from the state built afresh from the tables: a property test drives random
submissions, cycles (with preemptions), starts, ends, cancels, retries, reaps and changes of a
live cluster (nodes going away and coming back, other workloads taking GPUs) and compares the
two after every step (`Store.self_check`). The other tests show the locked section's check: a
cycle decided outside the lock is decided again when a job it decided about changed meanwhile,
and is written as it is when only unrelated jobs changed; a gap in the versions, or a cycle run
by another process, makes the Store build its state again.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from builders import cluster, teams
from hypothesis import given, note, settings
from hypothesis import strategies as st
from sqlalchemy import text
from test_store import FAST, spec

import berth.store.runner as runner_module
from berth.store import ClusterView, Store
from berth.store.mirror import Mirror, MirrorDiverged
from scheduling.cluster import Cluster
from scheduling.policy import Policy
from scheduling.resources import Resources

CLUSTER = cluster(nodes=3, gpus=4, groups=2)
EXAMPLES = int(os.environ.get("BERTH_PROPERTY_EXAMPLES", "15"))
RANDOM = bool(os.environ.get("BERTH_PROPERTY_RANDOM"))  # fresh seeds: see test_properties.py
TEAMS = teams(a={"nominal": 6, "borrowing_limit": 6}, b=6)


@dataclass
class LiveView:
    """A live cluster as a discovery would give it: nodes come and go, others take GPUs."""

    full: Cluster
    gone: set[str] = field(default_factory=set)
    held: dict[str, Resources] = field(default_factory=dict)
    _cache: dict[frozenset, Cluster] = field(default_factory=dict)

    def __call__(self) -> ClusterView:
        key = frozenset(self.gone)
        if key not in self._cache:
            nodes = [n for n in self.full.nodes if n.name not in self.gone]
            self._cache[key] = _subcluster(self.full, nodes)
        return ClusterView(self._cache[key], dict(self.held))


def _subcluster(full: Cluster, nodes: list) -> Cluster:
    from scheduling.config import parse_cluster

    return parse_cluster(
        {
            "name": full.name,
            "nodes": [
                {"name": n.name, "gpus": 4, "gpu_groups": 2, "cpus": 64, "memory_gb": 512}
                for n in nodes
            ],
        }
    )


# One step of a random run, by weight: a busy cluster where b reclaims what a borrowed.
WEIGHTS = {
    "submit": 5.0,
    "schedule": 4.0,
    "start": 3.0,
    "end": 3.0,  # succeeded, failed or lost
    "stopped": 2.0,  # a victim's replicas are down: finish(preempted)
    "cancel": 0.5,
    "retry": 1.0,
    "reap": 0.5,
    "held": 1.0,
    "node": 0.5,
}


def step(rng: random.Random, s: Store, view: LiveView, t: float, n: int, las: bool = False) -> None:
    """One random operation at time t, as the platform's callers make them; with `las`, most
    jobs checkpoint (least attained service demotes only those)."""
    kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]

    def pick(*states: str) -> str | None:
        found = [j.id for j in s.jobs(states=states)]
        return rng.choice(found) if found else None

    if kind == "submit":
        team = rng.choice("aaabb")
        gpus, replicas = rng.choice([(0.5, 1), (1, 1), (1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
        kw = {"priority": rng.choice([-1, 0, 0, 1])}
        if rng.random() < 0.3:
            kw["time_limit_s"] = rng.choice([600, 3600])
        if las and rng.random() < 0.7:
            kw["checkpoint_every_s"] = rng.choice([60, 300])
        s.submit(
            spec(f"j{n}", team=team, gpus=gpus, replicas=replicas, **kw), job_id=f"j{n}", now=t
        )
    elif kind == "schedule":
        s.schedule(now=t)
    elif kind == "start" and (job := pick("admitted")) and s.launchable(job):
        s.mark_started(job, s.status(job).attempt, now=t)
    elif kind == "end" and (job := pick("running", "admitted")):
        s.finish(job, rng.choice(["succeeded", "succeeded", "failed", "lost"]), now=t)
    elif kind == "stopped" and (job := pick("preempting")):
        s.finish(job, "preempted", now=t)
    elif kind == "cancel" and (job := pick("queued", "admitted", "running", "preempting")):
        s.cancel(job, now=t)
    elif kind == "retry" and (job := pick("failed")):
        s.retry(job, now=t)
    elif kind == "reap":
        s.reap(now=t, lease_s=600)
    elif kind == "held":
        node = f"n-{rng.randrange(3):03d}"
        gpus = rng.randrange(3)
        view.held[node] = Resources.of(gpus=gpus, cpus=rng.choice([0, 8]))
    elif kind == "node":  # n-000 stays: the cluster is never empty
        view.gone ^= {f"n-{rng.randrange(1, 3):03d}"}


def random_run(
    seed: int, steps: int, check: bool = True, url: str | None = None, policy: Policy = FAST
) -> Counter:
    """A random run on a live cluster, the mirror compared with a rebuild after every step;
    returns the events it made, by type. On a new SQLite file unless `url` is given."""
    rng = random.Random(seed)
    view = LiveView(CLUSTER)
    with (
        tempfile.TemporaryDirectory() as d,
        Store(url or f"sqlite:///{d}/b.db", None, TEAMS, policy, live=view) as s,
    ):
        for n in range(steps):
            step(rng, s, view, 30.0 * (n + 1), n, las=policy.las)
            if check:
                s.self_check()  # raises MirrorDiverged naming what differs
        return Counter(e.type for e in s.events())


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None)
@given(st.integers(0, 2**32 - 1))
def test_the_state_in_memory_never_differs_from_a_rebuild(seed: int) -> None:
    note(f"seed {seed}")
    random_run(seed, steps=300)


# Least attained service at 2 GPU-minutes: jobs of a few steps (30 s each) reach it; a
# demoted job that waits half its run time again is promoted back.
LAS_FAST = replace(
    FAST, name="berth-las-fast", las_demote_after_gpu_s=120.0, las_promote_after_x=0.5
)


@settings(max_examples=max(EXAMPLES // 3, 3), deadline=None, derandomize=not RANDOM, database=None)
@given(st.integers(0, 2**32 - 1))
def test_the_state_in_memory_never_differs_from_a_rebuild_under_las(seed: int) -> None:
    """Demotions and promotions written by the cycle that makes them, the service of each
    preempted run: a rebuild from the tables must agree after every step."""
    note(f"seed {seed}")
    seen = random_run(seed, steps=300, policy=LAS_FAST)
    note(f"events: {dict(seen)}")


def test_the_las_runs_demote_and_preempt_demoted_jobs() -> None:
    seen = sum(
        (random_run(seed, steps=300, check=False, policy=LAS_FAST) for seed in range(3)), Counter()
    )
    assert seen["demote"] >= 10 and seen["preempt"] >= 10 and seen["promote"] >= 1, seen


def test_the_random_runs_reach_what_must_be_compared() -> None:
    """The runs above are worth their time only if they preempt, requeue, lose and restart
    jobs while other workloads and nodes come and go."""
    seen = sum((random_run(seed, steps=300, check=False) for seed in range(5)), Counter())
    assert {"admit", "start", "preempt", "requeue", "lost", "fail", "cancel", "finish"} <= set(
        seen
    ), seen
    assert seen["preempt"] >= 10 and seen["admit"] >= 100, seen


def test_the_self_check_fails_on_a_state_that_drifted(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path}/b.db", CLUSTER, TEAMS, FAST) as s:
        s.submit(spec("a1", gpus=2), job_id="a1", now=0)
        s.schedule(now=1)
        s.self_check()
        s.runner.mirror.state.capacity.free[0] = 0  # a bug that forgets to give GPUs back
        with pytest.raises(MirrorDiverged, match="free"):
            s.self_check()


def _hook_decide(monkeypatch, hook: Callable[[], None]) -> list[int]:
    """Run `hook` once, right after the first decision (between deciding and the lock)."""
    calls: list[int] = []
    real = runner_module.decide

    def decide(mirror: Mirror, now: float):
        result = real(mirror, now)
        calls.append(len(result.admitted))
        if len(calls) == 1:
            hook()
        return result

    monkeypatch.setattr(runner_module, "decide", decide)
    return calls


def test_a_cycle_is_decided_again_when_a_job_it_admits_was_cancelled_meanwhile(
    tmp_path: Path, monkeypatch
) -> None:
    url = f"sqlite:///{tmp_path}/b.db"
    with Store(url, CLUSTER, TEAMS, FAST) as s, Store(url, CLUSTER, TEAMS, FAST) as other:
        s.submit(spec("a1", gpus=4), job_id="a1", now=0)
        s.submit(spec("a2", gpus=4), job_id="a2", now=1)
        s.schedule(now=2)  # builds the state; both admitted
        s.submit(spec("a3", gpus=4), job_id="a3", now=3)
        s.submit(spec("a4", gpus=4), job_id="a4", now=4)
        other.finish("a1", "succeeded", now=5)
        calls = _hook_decide(monkeypatch, lambda: other.cancel("a3", now=6))
        report = s.schedule(now=7)
        assert len(calls) == 2  # the first decision admitted a3: decided again
        assert report.admitted == ("a4",)
        assert s.status("a3").state == "cancelled" and s.status("a4").state == "admitted"
        s.self_check()


def test_a_cycle_is_written_as_decided_when_only_other_jobs_changed(
    tmp_path: Path, monkeypatch
) -> None:
    url = f"sqlite:///{tmp_path}/b.db"
    with Store(url, CLUSTER, TEAMS, FAST) as s, Store(url, CLUSTER, TEAMS, FAST) as other:
        s.submit(spec("a1", gpus=4), job_id="a1", now=0)
        s.schedule(now=1)
        s.submit(spec("a2", gpus=4), job_id="a2", now=2)
        calls = _hook_decide(monkeypatch, lambda: other.submit(spec("b1"), job_id="b1", now=3))
        report = s.schedule(now=4)
        assert len(calls) == 1 and report.admitted == ("a2",)  # b1 waits for the next cycle
        assert s.status("b1").state == "queued"
        s.self_check()  # b1 was taken in under the lock
        assert s.schedule(now=5).admitted == ("b1",)
        s.self_check()


def test_a_gap_in_the_versions_or_a_cycle_elsewhere_builds_the_state_again(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/b.db"
    with Store(url, CLUSTER, TEAMS, FAST) as s, Store(url, CLUSTER, TEAMS, FAST) as other:
        s.submit(spec("a1", gpus=4), job_id="a1", now=0)
        s.schedule(now=1)
        s.submit(spec("a2", gpus=4), job_id="a2", now=2)
        s.schedule(now=3)
        assert s.runner.builds == 1  # caught up from the events since
        with s.engine.begin() as conn:  # a write that logged nothing
            conn.execute(text("UPDATE engine SET version = version + 1"))
        s.submit(spec("a3", gpus=4), job_id="a3", now=4)
        assert s.schedule(now=5).admitted == ("a3",)
        assert s.runner.builds == 2
        other.submit(spec("b1", team="b", gpus=4), job_id="b1", now=6)
        other.schedule(now=7)  # a cycle run by another process
        s.submit(spec("b2", team="b", gpus=4), job_id="b2", now=8)
        assert other.status("b1").state == "admitted" and other.events("b1")[-1].type == "admit"
        report = s.schedule(now=9)  # sees b1 admitted, its victim stopping
        assert s.runner.builds == 3 and report.admitted == ()
        assert s.status("b2").reason_code == "quota"  # b1 and b2 are more than b's nominal
        s.self_check()
        assert sum(u.gpus for u in s.usage().values()) <= 12
