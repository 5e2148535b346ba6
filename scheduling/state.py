"""The engine's live state: what runs, what waits, what is free; snapshots and apply.

`EngineState` plays the part of Kueue's cache and queue manager together. The simulator keeps
one in memory; the SQL store rebuilds one from its tables. `apply` replays a cycle's decisions
onto it; it re-checks every allocation (Capacity.take refuses GPUs that are not free, and
Capacity.lacks_room CPUs or memory a node does not have), so a stale or buggy decision fails
loudly instead of double-allocating.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from sortedcontainers import SortedKeyList

from scheduling.capacity import Capacity
from scheduling.cluster import Cluster
from scheduling.decisions import CycleResult, Reservation
from scheduling.jobs import RESTARTED, Hold, Job, Pending, Placement, Running, clock_order
from scheduling.models import check_team_models, gpus_by_model, model_gpus
from scheduling.policy import Policy
from scheduling.quota import QuotaLedger, Team
from scheduling.resources import GPU_UNIT
from scheduling.run_times import RunTimes
from scheduling.snapshot import Snapshot


class StateError(RuntimeError):
    """A decision or event does not match the state (a bug or a stale decision)."""


def _order(p: Pending) -> tuple:
    return p.order


def _started(r: Running) -> tuple:
    return (r.start_time, r.job.id)


def _loss(r: Running) -> tuple:
    return r.loss


class EngineState:
    """Running jobs, queues, free capacity and quota usage, kept in step."""

    def __init__(self, cluster: Cluster, teams: Mapping[str, Team], policy: Policy) -> None:
        self.cluster = cluster
        self.teams = teams
        self.policy = policy
        self.capacity = Capacity(cluster)
        check_team_models(cluster, teams)
        self.quota = QuotaLedger(teams, model_gpus(cluster))
        self.running: dict[str, Running] = {}
        self.running_priorities: dict[str, Counter] = {t: Counter() for t in teams}
        self.running_by_start = SortedKeyList(key=_started)  # for the preemption victim pool
        # Per team, its preemptible running jobs, cheapest losses first, and their GPUs (milli):
        # reclaim past a lender's deadline takes from these without a scan of every job.
        self.preemptible_by_team: dict[str, SortedKeyList] = {}
        self.preemptible_gpus: dict[str, int] = {}
        self.pending: dict[str, Pending] = {}
        # team -> class of identical jobs (Pending.klass) -> its pending jobs in queue order
        self.queues: dict[str, dict[tuple, SortedKeyList]] = {t: {} for t in teams}
        self.holds: dict[str, Hold] = {}
        self.reservations: dict[str, Reservation] = {}
        self.preemptions: dict[str, int] = {}  # job -> times preempted so far
        self.last_preempted: dict[str, tuple[float, int]] = {}  # team -> (when, top priority)
        # Finished runs' times, where the policy reads them (its choice between GPU models):
        # whoever runs the state feeds them (the simulator, the store's loop).
        self.run_times: RunTimes | None = None
        self._origin: dict[str, Pending] = {}  # queue entries of running jobs: a preempted job
        self._seq = 0  # goes back to its old place
        # Least attained service (Policy.las_demote_after_gpu_s): per job, the GPU-seconds of
        # its earlier runs, and a heap of (when, job, its run's start) at which running jobs
        # reach the threshold (stale entries are skipped when popped).
        self.attained: dict[str, float] = {}
        self._demotions: list[tuple[float, str, float]] = []
        # Demoted jobs waiting again, by when they are promoted back (Policy.las_promote_after_x):
        # (when, job, the wait's start); stale entries are skipped when popped.
        self._promotions: list[tuple[float, str, float]] = []

    # -- events from outside ----------------------------------------------------------------

    def submit(self, job: Job, now: float) -> Pending:
        """Queue a job (already checked by admission.check_job)."""
        if job.id in self.pending or job.id in self.running or job.id in self.holds:
            raise StateError(f"job {job.id} is already known")
        self._seq += 1
        return self._enqueue(Pending(job, now, self._seq))

    def finish(self, job_id: str) -> Running:
        """A running job ended: free what it held."""
        run = self.running.pop(job_id, None)
        if run is None:
            raise StateError(f"job {job_id} is not running")
        self._unindex(run)
        self._release(run.job, run.placement)
        self._origin.pop(job_id, None)
        self.preemptions.pop(job_id, None)
        self.attained.pop(job_id, None)
        return run

    def cancel(self, job_id: str) -> Job | None:
        """Drop a job wherever it is; returns it, or None if unknown."""
        if job_id in self.running:
            return self.finish(job_id).job
        if job_id in self.holds:
            hold = self.holds.pop(job_id)
            self.capacity.give_placement(hold.bound, hold.job.cpu, hold.job.mem)
            self.quota.remove(hold.job.team, hold.job.demand)
            return hold.job
        if job_id in self.pending:
            self.reservations.pop(job_id, None)
            return self._dequeue(job_id).job
        return None

    # -- restoring a state kept elsewhere (the SQL store) ------------------------------------

    def forget(self, job_id: str) -> None:
        """Drop every trace of a job (its row changed: the store puts it back as the row now
        says, with restore_running or restore_pending). Unknown jobs are ignored."""
        self.cancel(job_id)
        self.preemptions.pop(job_id, None)
        self._origin.pop(job_id, None)
        self.attained.pop(job_id, None)

    def restore_running(
        self,
        job: Job,
        placement: Placement,
        start_time: float,
        preemptions: int = 0,
        *,
        enqueued: float,
        seq: int,
    ) -> Running:
        """Put back an admitted or running job without a cycle, holding its placement.

        The SQL store rebuilds the state from its tables before every cycle. `enqueued` and
        `seq` are the job's place in its queue, where a preemption sends it back. Taking the
        placement re-checks it (Capacity.take refuses GPUs that are not free), so rows that
        claim the same GPU twice fail loudly here.
        """
        self._check_new(job)
        self.capacity.take_placement(placement, job.cpu, job.mem)
        self.quota.add(job.team, job.demand)
        self._count_models(job, placement, 1)
        run = Running(job, placement, start_time, preemptions)
        self.running[job.id] = run
        self._index(run)
        self._origin[job.id] = Pending(job, enqueued, seq)
        self._seq = max(self._seq, seq)
        return run

    def restore_pending(
        self,
        job: Job,
        enqueued: float,
        seq: int,
        not_before: float = 0.0,
        preemptions: int = 0,
        since: float | None = None,
    ) -> Pending:
        """Put back a queued job at its old place (`enqueued`, `seq`) without a cycle; `since`
        is when its current wait began (its last preemption or loss), `enqueued` if None."""
        self._check_new(job)
        self._seq = max(self._seq, seq)
        if preemptions:
            self.preemptions[job.id] = preemptions
        wait = enqueued if since is None else max(since, enqueued)
        return self._enqueue(Pending(job, enqueued, seq, not_before=not_before, since=wait))

    def clone(self) -> EngineState:
        """An independent copy (a forward run on it leaves this state as it is: the ETA,
        scheduling/eta.py). Gangs held in part (baseline policies only) are not copied."""
        if self.holds:
            raise StateError("a state with held gangs cannot be cloned (baseline policies)")
        new = EngineState(self.cluster, self.teams, self.policy)
        for run in self.running_by_start:
            # A gang admitted from a hold (baselines) has no queue entry: it goes back, if
            # preempted, as if queued when it started.
            origin = self._origin.get(run.job.id) or Pending(run.job, run.start_time, 0)
            new.restore_running(
                run.job,
                run.placement,
                run.start_time,
                run.preemptions,
                enqueued=origin.enqueued,
                seq=origin.seq,
            )
        # What else holds capacity (GPUs of other workloads, or of victims still stopping, as
        # the store's mirror takes them) stays held: the copy takes this one's free capacity.
        new.capacity = self.capacity.clone()
        for p in self.pending.values():
            new._enqueue(p)  # immutable: shared
        new._seq = self._seq
        new.preemptions = dict(self.preemptions)
        new.reservations = dict(self.reservations)
        new.last_preempted = dict(self.last_preempted)
        new.attained = dict(self.attained)
        new._demotions = list(self._demotions)
        new._promotions = list(self._promotions)
        new.run_times = self.run_times  # read only by cycles: shared
        return new

    # -- least attained service --------------------------------------------------------------

    def attained_s(self, run: Running, now: float) -> float:
        """GPU-seconds of service the job has had by `now`, over all its runs."""
        return self.attained.get(run.job.id, 0.0) + run.gpu / GPU_UNIT * (now - run.start_time)

    def demote_due(self, now: float) -> list[Running]:
        """Demote the running jobs that reached the policy's attained-service threshold by
        `now` (least attained service, `Policy.las_demote_after_gpu_s`): each goes below its
        priority's other jobs, for good. Whoever runs the cycles calls this before each
        snapshot; returns the runs as they are now (demoted), for the event log."""
        out = []
        heap = self._demotions
        while heap and heap[0][0] <= now:
            _, job_id, start = heapq.heappop(heap)
            run = self._undemoted_run(job_id, start)
            if run is None:
                continue  # ended or preempted since
            self._unindex(run)
            self._count_rank(run.job, -1)
            job = replace(run.job, demoted=True)
            new = self.running[job_id] = Running(job, run.placement, start, run.preemptions)
            self._index(new)
            origin = self._origin.get(job_id)
            if origin is not None:  # preempted later, it goes back as demoted
                self._origin[job_id] = replace(origin, job=job)
            out.append(new)
        return out

    def promote_due(self, now: float) -> list[Pending]:
        """Promote the demoted jobs that have waited, since their preemption, what the policy
        allows (`Policy.las_promote_after_x`): each goes back up to its priority, at its old
        place in the queue, and is not demoted again (its service stays above the threshold,
        which `_index` reads as promoted). Called with `demote_due`; returns the queue entries
        as they are now (their wait's start unchanged), for the event log."""
        out = []
        heap = self._promotions
        while heap and heap[0][0] <= now:
            _, job_id, since = heapq.heappop(heap)
            p = self._demoted_wait(job_id, since)
            if p is None:
                continue  # admitted, ended or preempted again since
            self._dequeue(job_id)
            out.append(self._enqueue(replace(p, job=replace(p.job, demoted=False))))
        return out

    def next_promotion(self) -> float | None:
        """When the next demoted job waiting is promoted; None if none will be."""
        heap = self._promotions
        while heap:
            _, job_id, since = heap[0]
            if self._demoted_wait(job_id, since) is not None:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    def upcoming_demotions(self) -> dict[tuple[str, int], tuple[float, str]]:
        """Per (team, rank), the earliest demotion to come of a running job: (when, job). A
        waiting job of that team and rank may preempt it from then (`reasons.after_demotion`)."""
        out: dict[tuple[str, int], tuple[float, str]] = {}
        for when, job_id, start in self._demotions:
            run = self._undemoted_run(job_id, start)
            if run is None:
                continue
            key = (run.job.team, run.job.rank)
            if key not in out or (when, job_id) < out[key]:
                out[key] = (when, job_id)
        return out

    def next_las_change(self) -> float | None:
        """When the next demotion or promotion is due; None if none will be."""
        times = [t for t in (self.next_demotion(), self.next_promotion()) if t is not None]
        return min(times, default=None)

    def next_demotion(self) -> float | None:
        """When the next running job reaches the threshold; None if none will."""
        heap = self._demotions
        while heap:
            _, job_id, start = heap[0]
            if self._undemoted_run(job_id, start) is not None:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    def _undemoted_run(self, job_id: str, start: float) -> Running | None:
        """The run a demotion heap entry was made for, if it still runs undemoted."""
        run = self.running.get(job_id)
        return run if run is not None and run.start_time == start and not run.job.demoted else None

    def _demoted_wait(self, job_id: str, since: float) -> Pending | None:
        """The wait a promotion heap entry was made for, if the job still waits demoted."""
        p = self.pending.get(job_id)
        return p if p is not None and p.since == since and p.job.demoted else None

    def _check_new(self, job: Job) -> None:
        if job.id in self.pending or job.id in self.running or job.id in self.holds:
            raise StateError(f"job {job.id} is already known")
        if job.team not in self.teams:
            raise StateError(f"job {job.id}: unknown team {job.team}")

    # -- the cycle --------------------------------------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        return Snapshot(
            now=now,
            cluster=self.cluster,
            teams=self.teams,
            capacity=self.capacity,
            quota=self.quota,
            running=self.running,
            running_priorities=self.running_priorities,
            running_by_start=self.running_by_start,
            preemptible_by_team=self.preemptible_by_team,
            preemptible_gpus=self.preemptible_gpus,
            queues=self.queues,
            pending=self.pending,
            holds=self.holds,
            reservations=self.reservations,
            last_preempted=self.last_preempted,
            run_times=self.run_times,
        )

    def apply(self, result: CycleResult) -> None:
        """Make a cycle's decisions true, in the order that keeps every step valid."""
        now = result.now
        for ev in result.evicted:
            hold = self.holds.pop(ev.job_id)
            self.capacity.give_placement(hold.bound, hold.job.cpu, hold.job.mem)
            self.quota.remove(hold.job.team, hold.job.demand)
            self._seq += 1
            self._enqueue(Pending(hold.job, now, self._seq, not_before=ev.retry_at))
        for pre in result.preempted:
            run = self.running.pop(pre.job_id, None)
            if run is None:
                raise StateError(f"cannot preempt {pre.job_id}: it is not running")
            self._unindex(run)
            self._release(run.job, run.placement)
            self.preemptions[pre.job_id] = run.preemptions + 1
            if self.policy.las:
                self.attained[pre.job_id] = self.attained_s(run, now)
            team, prio = run.job.team, run.job.rank
            when, top = self.last_preempted.get(team, (None, prio))
            self.last_preempted[team] = (now, max(prio, top) if when == now else prio)
            # Back to the queue, its waiting clock started again now: among jobs identical to
            # it whose wait restarted too, by that clock; among the others, at its old place.
            self._enqueue(replace(self._origin.pop(pre.job_id), since=now))
        for hu in result.holds:
            self._bind(hu.job, hu.bound, now)
        for adm in result.admitted:
            job = adm.job
            if job.id in self.holds:
                self._bind(job, adm.placement.replicas, now)
                del self.holds[job.id]
            else:
                lacking = self.capacity.lacks_room(adm.placement, job.cpu, job.mem)
                if lacking:
                    raise StateError(f"cannot admit {job.id}: {lacking}")
                self._origin[job.id] = self._dequeue(job.id)
                self.capacity.take_placement(adm.placement, job.cpu, job.mem)
                self.quota.add(job.team, job.demand)
            self._count_models(job, adm.placement, 1)
            run = Running(job, adm.placement, now, self.preemptions.get(job.id, 0))
            self.running[job.id] = run
            self._index(run)
        self.reservations = dict(result.reservations)

    # -- internals --------------------------------------------------------------------------

    def _bind(self, job: Job, bound: tuple, now: float) -> None:
        hold = self.holds.get(job.id)
        if hold is None:  # admitted by quota just now
            self._dequeue(job.id)
            self.quota.add(job.team, job.demand)
            already: tuple = ()
            since = now
        else:
            already, since = hold.bound, hold.since
        if bound[: len(already)] != already:
            raise StateError(f"hold update for {job.id} drops replicas already bound")
        self.capacity.take_placement(bound[len(already) :], job.cpu, job.mem)
        self.holds[job.id] = Hold(job, tuple(bound), since)

    def _count_models(self, job: Job, placement: Placement, sign: int) -> None:
        """A running job's GPUs per model, counted against its team's per-model quotas."""
        if self.quota.declared_models(job.team):
            by_model = gpus_by_model(self.cluster, placement.replicas)
            if sign > 0:
                self.quota.add_models(job.team, by_model)
            else:
                self.quota.remove_models(job.team, by_model)

    def _index(self, run: Running) -> None:
        job = run.job
        self.running_by_start.add(run)
        self.running_priorities[job.team][job.rank] += 1
        if (
            self.policy.las
            and not job.demoted
            and job.preemptible
            and job.checkpoint_s != math.inf
            and run.gpu > 0
        ):
            gpus = run.gpu / GPU_UNIT
            limit = self.policy.las_limit_gpu_s(gpus)
            left = limit - self.attained.get(job.id, 0.0)
            # A job with its service but not demoted was promoted (`promote_due`): for good.
            # Its service was summed in floats, so "with its service" allows for rounding.
            if left > limit * 1e-9 + 1e-6 or self.policy.las_promote_after_x == math.inf:
                when = run.start_time + max(0.0, left) / gpus
                heapq.heappush(self._demotions, (when, job.id, run.start_time))
        if job.preemptible:
            runs = self.preemptible_by_team.get(job.team)
            if runs is None:
                runs = self.preemptible_by_team[job.team] = SortedKeyList(key=_loss)
            runs.add(run)
            gpus = self.preemptible_gpus.get(job.team, 0)
            self.preemptible_gpus[job.team] = gpus + job.demand.gpu

    def _unindex(self, run: Running) -> None:
        job = run.job
        self.running_by_start.remove(run)
        if job.preemptible:
            self.preemptible_by_team[job.team].remove(run)
            self.preemptible_gpus[job.team] -= job.demand.gpu

    def _release(self, job: Job, placement: Placement) -> None:
        """A running job stops (finish, preemption, cancel)."""
        self.capacity.give_placement(placement, job.cpu, job.mem)
        self.quota.remove(job.team, job.demand)
        self._count_models(job, placement, -1)
        self._count_rank(job, -1)

    def _count_rank(self, job: Job, sign: int) -> None:
        prios = self.running_priorities[job.team]
        prios[job.rank] += sign
        if not prios[job.rank]:
            del prios[job.rank]

    def _enqueue(self, p: Pending) -> Pending:
        if p.job.team not in self.queues:
            raise StateError(f"unknown team {p.job.team}")
        self.pending[p.job.id] = p
        if p.job.demoted and self.policy.las_promote_after_x != math.inf:
            attained = self.attained.get(p.job.id, 0.0)
            wait = self.policy.las_promote_wait_s(p.job.demand.gpu / GPU_UNIT, attained)
            heapq.heappush(self._promotions, (p.since + wait, p.job.id, p.since))
        classes = self.queues[p.job.team]
        queue = classes.get(p.klass)
        if queue is None:
            key = clock_order if p.klass[-1] == RESTARTED else _order
            queue = classes[p.klass] = SortedKeyList(key=key)
        queue.add(p)
        return p

    def _dequeue(self, job_id: str) -> Pending:
        p = self.pending.pop(job_id, None)
        if p is None:
            raise StateError(f"job {job_id} is not pending")
        classes = self.queues[p.job.team]
        queue = classes[p.klass]
        queue.remove(p)
        if not queue:
            del classes[p.klass]
        return p
