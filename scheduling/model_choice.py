"""A slower GPU model now, or a faster one soon: where a job is expected to finish first.

A job that accepts several GPU models, and finds room now only on a slower one than it could
use, waits for the faster model when it is expected to finish sooner there, as Gavel and Sia
argue for heterogeneous clusters: its expected run on the faster model plus the expected wait
for that model's GPUs, against its expected run on the slower model now. Meanwhile the slower
GPUs go to the jobs behind it, which lose less on them.

- Its expected run: its team's mean run in ideal seconds (`scheduling/run_times.py`), over the
  model's speed (the cluster's `gpu_speed`), and never more than its time limit.
- The expected wait: when enough of the faster model's GPUs free for it and for the jobs
  ahead of it in this cycle that wait for them (their claims: jobs that chose to wait for that
  model too, and jobs that accept it and found no room at all), the running jobs there ending
  after their teams' mean residual runs. Optimistic where it cannot know better: it leaves out
  topology. So under a long queue jobs take what is free, and on a quiet cluster they wait
  for the faster GPUs about to free.
- Bounded: a job waits for a faster model only while what it has waited in this wait, plus the
  wait to come, is less than what that model saves it; so estimates that stay wrong, or jobs
  ahead that keep taking the faster GPUs, cost it at most that saving, and the cycle wakes
  when the bound passes (`FasterModel.until`). A job holding a reservation (it starved) and a
  mixed-model job never wait.

The decision is monotone in a job's clock, so jobs of one class decide alike (the cycle's
class closing, `scheduling/shortcuts.py`): the one that waited longest has the least left to
wait for; if it waits, the others do. For that, a job's wait leaves out its own class's
claims, and a class closed on waiting claims for all its jobs at once, as examining each of
them would. Decision: docs/decisions/0022.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduling.models import accepted_models
from scheduling.resources import GPU_UNIT

if TYPE_CHECKING:
    from scheduling.capacity import Capacity
    from scheduling.cluster import Cluster
    from scheduling.jobs import Job, Pending, Placement
    from scheduling.run_times import RunTimes
    from scheduling.snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class FasterModel:
    """Why a job waits for a faster model: it, and what the job expects there and here."""

    model: str
    wait_s: float  # expected wait for enough of its GPUs
    run_s: float  # expected run there
    slower: str  # the model it has room on now
    slower_run_s: float  # expected run there
    until: float  # when it stops waiting for it, at the latest (the cycle wakes then)


class ModelChoice:
    """One cycle's choices between models. The running jobs' expected ends per model are
    worked out once, when a job first asks (only a cluster of several models ever does)."""

    def __init__(self, snap: Snapshot, run_times: RunTimes) -> None:
        self.snap = snap
        self.run_times = run_times
        self._ends: dict[str, list[tuple[float, int]]] | None = None
        self._claims: dict[str, int] = {}  # model -> GPUs the jobs waiting for it need
        self._class_claims: dict[tuple, int] = {}  # (team, class) -> its part of them

    def claim(self, pending: Pending, models: Iterable[str], jobs: int = 1) -> None:
        """`jobs` jobs of `pending`'s class wait for GPUs of `models` (a faster model they
        chose to wait for, or every model they accept where they found no room at all): the
        next jobs' waits for those models count their GPUs."""
        gpus = _need(pending.job) * jobs
        for m in models:
            self._claims[m] = self._claims.get(m, 0) + gpus
            key = (pending.job.team, pending.klass, m)
            self._class_claims[key] = self._class_claims.get(key, 0) + gpus

    def faster(
        self,
        cap: Capacity,
        pending: Pending,
        placement: Placement,
        models: tuple[str, ...] | None = None,
    ) -> FasterModel | None:
        """The faster model `pending`'s job should wait for rather than take `placement` (on a
        slower one) now; None: take it. `models`: the models its team's per-model quotas leave
        it (None: every model it accepts)."""
        job = pending.job
        cluster = cap.cluster
        if job.mixed_models or len(cluster.model_nodes) < 2:
            return None
        speed = cluster.gpu_speed
        here = cluster.nodes[placement.replicas[0].node].gpu_model
        slow = speed.get(here, 1.0)
        faster = [
            m
            for m in accepted_models(cluster, job)
            if speed.get(m, 1.0) > slow and (models is None or m in models)
        ]
        if not faster:
            return None
        now = self.snap.now
        work = self.run_times.typical(job.team)  # ideal seconds
        # The model it is expected to finish first on, whatever it has waited: so the choice
        # is the same for every job of its class, and only the bound below reads its clock.
        best: tuple[float, str, float, float] | None = None  # (finish, model, wait, run)
        for m in faster:
            run = _run_s(job, work, speed.get(m, 1.0))
            ahead = self._claims.get(m, 0) - self._class_claims.get((job.team, pending.klass, m), 0)
            wait = self._wait_s(cap, cluster, job, m, now, ahead)
            if best is None or wait + run < best[0]:
                best = (wait + run, m, wait, run)
        assert best is not None
        _, model, wait, run = best
        slower_run = _run_s(job, work, slow)
        saving = slower_run - run
        if now - pending.since + wait >= saving:
            return None  # not sooner, or it has waited what the faster model would save it
        return FasterModel(model, wait, run, here, slower_run, pending.since + saving)

    def _wait_s(
        self, cap: Capacity, cluster: Cluster, job: Job, model: str, now: float, ahead: int
    ) -> float:
        """How long until enough of `model`'s GPUs are free for the job and the `ahead` GPUs
        claimed before it (whole GPUs; a share counts one), the running jobs there ending as
        expected; inf if they never are."""
        free, hidden = cap.free, cap.hidden
        have = sum(free[i].bit_count() for i in cluster.model_nodes[model] if i not in hidden)
        # Enough GPUs in all but not in a shape that fits (a node, a group): one end at least.
        lack = max(_need(job) + ahead - have, 1)
        for end, gpus in self._ends_on(model):
            lack -= gpus
            if lack <= 0:
                return max(0.0, end - now)
        return math.inf

    def _ends_on(self, model: str) -> list[tuple[float, int]]:
        if self._ends is None:
            self._ends = _expected_ends(self.snap, self.run_times)
        return self._ends.get(model, [])


def _need(job: Job) -> int:
    return max(1, math.ceil(job.demand.gpu / GPU_UNIT))


def _run_s(job: Job, work: float, speed: float) -> float:
    return min(work / speed, job.time_limit_s)


def _expected_ends(snap: Snapshot, run_times: RunTimes) -> dict[str, list[tuple[float, int]]]:
    """Per model, (expected end, whole GPUs freed there) of every running job, soonest first."""
    cluster, now = snap.cluster, snap.now
    model_of = [n.gpu_model for n in cluster.nodes]
    speed = cluster.gpu_speed
    out: dict[str, list[tuple[float, int]]] = {}
    for run in snap.running.values():
        job = run.job
        per_model: dict[str, int] = {}
        for node, gpus in run.gpus_by_node:
            m = model_of[node]
            per_model[m] = per_model.get(m, 0) + gpus
        s = min(speed.get(m, 1.0) for m in per_model) if per_model else 1.0
        elapsed = now - run.start_time
        end = now + run_times.remaining(job.team, elapsed * s) / s
        end = max(now, min(end, run.start_time + job.time_limit_s))
        for m, gpus in per_model.items():
            if gpus:
                out.setdefault(m, []).append((end, gpus))
    for ends in out.values():
        ends.sort()
    return out
