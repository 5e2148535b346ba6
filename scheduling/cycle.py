"""One scheduling cycle: an immutable snapshot in, decisions out.

    schedule(snapshot, policy)
      1. copy      private copies of free capacity and quota usage; the snapshot stays as it is
      2. gangs     the policy's gang binding binds held gangs (Berth holds none; the
                   quota-spread baseline binds more replicas of partly bound gangs, or times
                   them out)
      3. reserve   hide the nodes reserved for starving gangs from everyone else (not while
                   their holder is blocked by quota)
      4. order     teams' heads as Kueue orders a cohort: within nominal before borrowing,
                   then priority, then weighted DRF; inside a team priority, then FIFO
      5. nominate  per job: quota AND a placement of every replica, in one step; else a
                   preemption plan; else a reason (and, if it starves, a reservation). Each
                   examined job gets a `Nomination` with its status (fits, preempts,
                   reserved, needs_preemption, blocked, skipped) and reason, in order
      6. explain   a reason for every job left pending

Placement, gang binding and what a blocked job does to the queue behind it are the policy's
strategies (`scheduling/strategies.py`); the baselines' live in the simulator.

Kueue's scheduler.schedule() tells its cycle the same way. Everything here is pure: persistence
and side effects belong to whoever applies the result (`state.EngineState.apply`, the store).
"""

from __future__ import annotations

import math

from scheduling import reasons
from scheduling.backfill import Shadows, backfill_nodes
from scheduling.cluster import CLUSTER
from scheduling.cycle_preemption import PreemptionSteps
from scheduling.decisions import (
    Admit,
    CycleResult,
    Nomination,
    PendingReason,
    Reason,
    Status,
)
from scheduling.jobs import Job, Pending, Placement, Running, rank_words
from scheduling.model_choice import FasterModel, ModelChoice
from scheduling.model_quotas import ModelQuotaPlacer
from scheduling.models import accepted_models, gpus_by_model
from scheduling.ordering import Candidates
from scheduling.policy import Policy
from scheduling.reservation import choose_reservation
from scheduling.shortcuts import FAST, Shortcuts, closed_class_wakes, mate_holds
from scheduling.snapshot import Snapshot
from scheduling.victim_index import NodeIndex
from scheduling.victims import VictimPool


def schedule(snapshot: Snapshot, policy: Policy, shortcuts: Shortcuts = FAST) -> CycleResult:
    """Run one cycle. Never changes `snapshot`. `shortcuts`: `EXACT` to check that the speed
    shortcuts change nothing (scheduling/shortcuts.py)."""
    cycle = Cycle(snapshot, policy, shortcuts)  # 1. copy
    policy.gangs.bind_held(cycle)  # 2. gangs
    cycle.hide_reservations()  # 3. reserve
    # 4. order; in an organization tree a team's admission moves its cohorts' shares, which
    # the keys of the teams under its top cohort hold too
    related = cycle.quota.same_top if cycle.quota.tree else _alone
    candidates = Candidates(snapshot, policy.ordering, cycle.share, cycle.borrows, related)
    for pending in candidates:
        cycle.nominate(pending, candidates)  # 5. nominate
        if cycle.stopped_by is not None:
            break
    cycle.explain_rest()  # 6. explain
    r = cycle.result
    r.fixed_point = not (r.admitted or r.preempted or r.holds or r.evicted) and (
        r.reservations == snapshot.reservations
    )
    return r


def _alone(team: str) -> tuple[str, ...]:
    return (team,)


# A team that lost a job at this instant admits none of lower priority at this instant (no
# priority inversion); those wait for the next one, this much later, which must come even if
# nothing else happens (the shortcuts' test found a job left waiting ten minutes for it).
NEXT_INSTANT_S = 1.0


class Cycle(PreemptionSteps):
    """The scratch state of one cycle and the decisions it has made so far. Strategies see it
    as `strategies.CycleOps`."""

    def __init__(self, snap: Snapshot, policy: Policy, shortcuts: Shortcuts = FAST) -> None:
        self.snap = snap
        self.policy = policy
        self.fast = shortcuts.on
        self.now = snap.now
        self.cap = snap.capacity.clone()
        self.quota = snap.quota.clone()
        self.result = CycleResult(snap.now)
        self.failed = self.result.by_shape
        self.no_room: dict[tuple, PendingReason] = {}
        # key -> failed (gpu, cpu, mem, guarded) searches
        self.no_plan: dict[tuple, list[tuple[int, int, int, bool]]] = {}
        self.admitted_ids: set[str] = set()
        # Per team, the lowest priority admitted and the highest preempted in this cycle: no
        # job is preempted while a lower-priority job of its team is admitted (either order).
        self.admitted_floor: dict[str, int] = {}
        self.preempted_ceiling = {
            team: prio for team, (t, prio) in snap.last_preempted.items() if t == snap.now
        }
        self.victim_pool: VictimPool | None = None
        self.node_indexes: dict[tuple, NodeIndex] = {}  # the one-node searches' (shortcut 6)
        self.next_victim: Running | None = None  # the last failed search's next hope
        self.searches: dict[tuple[str, bool], int] = {}  # per (team, reclaims) in this cycle
        self.victims: set[str] = set()
        self.total = snap.cluster.total
        # Per-model quotas (`gpus.<MODEL>` keys) narrow the models a job may be placed on;
        # a cluster whose teams declare none places as the policy does, at no cost.
        self.model_quotas = (
            policy.quotas and snap.quota.has_models and not policy.gangs.holds_partial
        )
        self.within_models = ModelQuotaPlacer(self.quota, snap.cluster, policy.placement)
        self.place = self.within_models if self.model_quotas else policy.placement
        self.waits_for: dict[str, FasterModel] = {}  # jobs waiting for a faster model
        self.model_choice = (
            ModelChoice(snap, snap.run_times)
            if policy.expected_finish_models and snap.run_times is not None
            else None
        )
        self.stopped_by: PendingReason | None = None
        self.suspended: set[str] = set()  # reservations whose holder is blocked by quota
        self.shadows = Shadows(snap)  # when each reservation's nodes drain (EASY backfill)
        self.running_floor: dict[str, int | None] = {}  # team -> its lowest running priority

    def share(self, team: str) -> float | tuple[float, ...]:
        if self.quota.tree:  # a department's share first, then its teams'
            return self.quota.tree_share(team, self.total)
        return self.quota.dominant_share(team, self.total)

    def borrows(self, pending: Pending) -> bool:
        """Would admitting this job take its team above its nominal quota?"""
        job = pending.job
        return not self.quota.fits_nominal_with(job.team, job.demand)

    # -- phase 3: reservations -------------------------------------------------------------

    def hide_reservations(self) -> None:
        held = [
            (job_id, res)
            for job_id, res in self.snap.reservations.items()
            if job_id in self.snap.pending
        ]
        # A holder blocked by quota, not placement, could not use its nodes: they are not
        # hidden this cycle (others may use them), but the reservation is kept, so that the
        # same nodes drain again once quota allows it (new nodes each time would restart it).
        for job_id, res in held:
            job = self.snap.pending[job_id].job
            self.result.reservations[job_id] = res
            if self.quota.check(job.team, job.demand, job.preemptible) is None:
                self.cap.hide(res.nodes)
            else:
                self.suspended.add(job_id)
        held = [(job_id, res) for job_id, res in held if job_id not in self.suspended]
        # A holder goes first: it has starved long enough, and in queue order it may sit
        # behind a job of its own class that fails (the hidden nodes are not for that one)
        # and closes the class before the holder's turn.
        for job_id, res in held:
            job = self.snap.pending[job_id].job
            if self.fast and not job.shared:
                # Not enough free GPUs outside the other reservations: skip the placement
                # attempt (and the unhiding and hiding it costs), which could only fail.
                own = sum(self.cap.free_gpus(i) for i in res.nodes)
                if self.cap.domain_free[CLUSTER][CLUSTER] + own < job.whole_gpus * job.replicas:
                    continue
            if job.rank < self.preempted_ceiling.get(job.team, job.rank):
                self._wait_for_next_instant()
                continue  # its team just lost a job of higher priority: that one goes first
            if self.quota.check(job.team, job.demand, job.preemptible) is None:
                placement = self._place(job)
                if placement is not None:
                    self._admit(job, placement)
                    self._nominated(job, Status.RESERVED)

    # -- phase 5: nominate -----------------------------------------------------------------

    def nominate(self, pending: Pending, candidates: Candidates) -> None:
        job = pending.job
        if job.id in self.admitted_ids:
            return  # a reservation holder, admitted in phase 3
        if pending.not_before > self.now:
            reason = PendingReason(
                Reason.BACKOFF,
                f"requeued after a gang timeout; next try at t={pending.not_before:g}",
            )
            self.result.pending[job.id] = reason
            self._nominated(job, Status.SKIPPED, reason)
            self.wake(pending.not_before)
            return
        result = self.result
        result.examined += 1
        status, reason = self._admit_or_explain(pending, candidates)
        result.nominations.append(Nomination(job.id, job.team, status, reason))
        if reason is None:
            candidates.changed(job.team)
            return
        result.pending[job.id] = reason
        if self.model_choice is not None:
            self.model_choice.claim(pending, self._claimed_models(pending, reason))
        policy = self.policy
        self.stopped_by = policy.queue.blocked(self, pending)
        if self.stopped_by is not None:
            return
        reservations = result.reservations
        if (
            job.id not in reservations or len(reservations) >= policy.max_reservations
        ) and not mate_holds(pending, reservations, self.snap.pending):
            # The rest of its class would fail alike: close it; they share this reason. Not
            # while it holds a reservation and more are allowed: a starving class-mate may
            # get one too (it cannot do better than this job otherwise). Nor while a
            # class-mate holds one: that one may use its own nodes, and with EASY backfill
            # this job's (found by the shortcut property test, seed 2285996683).
            if self.fast:
                self.failed[(job.team, pending.klass)] = reason
                candidates.close_class(job.team, pending.klass)
                if self.model_choice is not None:
                    self._claim_for_mates(pending, reason)
                on_quota = reason.code == Reason.QUOTA
                may_preempt = status is Status.NEEDS_PREEMPTION
                if may_preempt or not on_quota:  # else its mates owe nothing: most classes
                    queue = self.snap.queues.get(job.team, {}).get(pending.klass, ())
                    for t in closed_class_wakes(
                        queue,
                        pending,
                        policy,
                        self.now,
                        on_quota=on_quota,
                        may_preempt=may_preempt,
                    ):
                        self.wake(t)
            else:  # examine them here, where closing the class skips them
                for mate in candidates.take_class(job.team, pending.klass):
                    self.nominate(mate, candidates)
                    if self.stopped_by is not None:
                        return
        if reason.code == Reason.QUOTA:
            return
        starves_at = pending.since + policy.starvation_s
        if starves_at > self.now:
            # The starvation guard (a reservation) will look at it again then. It has nothing
            # for a job that waits on quota: within its nominal, reclaim's bound serves it;
            # borrowing, it has no claim. A finish, which may change that, runs a cycle.
            self.wake(starves_at)

    def _admit_or_explain(
        self, pending: Pending, candidates: Candidates
    ) -> tuple[Status, PendingReason | None]:
        """Admit the job (with a preemption plan if it needs one), or say why it waits."""
        job = pending.job
        ceiling = self.preempted_ceiling.get(job.team)
        if ceiling is not None and job.rank < ceiling:
            self._wait_for_next_instant()
            return Status.SKIPPED, PendingReason(
                Reason.BEHIND,
                f"a job of team {job.team} with {rank_words(ceiling)} was preempted just now; it "
                "goes back to the queue first",
            )
        problem = None
        if self.policy.quotas:
            problem = self.quota.check(job.team, job.demand, job.preemptible)
            if problem is None and self.model_quotas:
                problem = self.within_models.problem(job)
                if problem is not None:
                    reason = reasons.quota(job.team, problem.resource, problem.limit)
                    return self._reclaim_model(pending, candidates, reason)
        if problem is None:
            reason = self.policy.gangs.bind(self, job)
            if reason is None:
                return Status.FITS, None
            if reason.code == Reason.FASTER_MODEL:
                return Status.BLOCKED, reason  # it could run now: it chose to wait
            # The models its team's keys leave it have no room, while a model it lent does
            # once that model's borrowers go: it takes that model back first.
            if self.model_quotas and self._try_model_reclaim(pending, candidates):
                return Status.PREEMPTS, None
        else:
            reason = reasons.quota(job.team, problem.resource, problem.limit)
        self.next_victim = None
        allowed_at = self._may_preempt(pending)
        status = Status.BLOCKED if allowed_at is None else Status.NEEDS_PREEMPTION
        if allowed_at is not None and allowed_at <= self.now:
            plan = self._plan_preemption(pending)
            if plan is not None:
                self._admit_with_preemption(job, plan, candidates)
                return Status.PREEMPTS, None
        if reason.code == Reason.NO_PLACEMENT:
            self._maybe_reserve(pending)
        elif problem is not None and allowed_at is not None and self._reclaims(job):
            return status, self._reclaim_reason(job, problem, allowed_at)
        return status, reason

    def _claimed_models(self, pending: Pending, reason: PendingReason) -> tuple[str, ...]:
        """The GPU models a job that waits claims (`scheduling/model_choice.py`): the faster
        one it chose to wait for, or every one it accepts where it found no room at all."""
        assert self.model_choice is not None
        if reason.code == Reason.FASTER_MODEL:
            return (self.waits_for[pending.job.id].model,)
        if reason.code == Reason.NO_PLACEMENT:
            return accepted_models(self.snap.cluster, pending.job)
        return ()

    def _claim_for_mates(self, pending: Pending, reason: PendingReason) -> None:
        """A class closed: its other jobs claim what it claimed, as examining each would."""
        models = self._claimed_models(pending, reason)
        if not models:
            return
        queue = self.snap.queues[pending.job.team][pending.klass]
        mates = sum(
            1
            for mate in queue.islice(queue.index(pending) + 1)
            if mate.job.id not in self.admitted_ids and mate.not_before <= self.now
        )
        if mates:
            self.model_choice.claim(pending, models, mates)

    def _nominated(self, job: Job, status: Status, reason: PendingReason | None = None) -> None:
        self.result.nominations.append(Nomination(job.id, job.team, status, reason))

    def place_or_explain(self, job: Job) -> PendingReason | None:
        """Admit if a placement exists now; else why not. Placement failures do not depend on
        the team, so they are remembered for the whole cycle (capacity only shrinks in it)."""
        own_reservation = job.id in self.result.reservations
        opened = self._backfill(job)
        # replicas, gpu, cpu, mem, topology, GPU models (those its team's quotas leave it), MIG
        # profile; reserved nodes
        models = self.within_models.models(job) if self.model_quotas else None
        key = (*job.shape[1:6], job.gpu_models, models, job.mixed_models, job.mig, opened)
        if self.fast and not own_reservation and key in self.no_room:
            return self.no_room[key]
        placement = self._place(job, opened)
        if placement is not None:
            if self.model_choice is not None and not own_reservation:
                pending = self.snap.pending[job.id]
                choice = self.model_choice.faster(self.cap, pending, placement, models)
                if choice is not None:
                    self.waits_for[job.id] = choice
                    self.wake(choice.until)  # then it takes the slower model
                    self.result.estimates_move = True
                    return reasons.faster_model(choice)
            self._admit(job, placement)
            return None
        reason = reasons.no_placement(job)
        if not own_reservation and len(self.cap.hidden) > len(opened):
            reason = self._behind_reservations(job, reason)
        if not own_reservation:
            self.no_room[key] = reason
        return reason

    def _behind_reservations(self, job: Job, reason: PendingReason) -> PendingReason:
        """If the job would fit on nodes reserved for starving jobs: say so, and what time
        limit would let it use them now (EASY backfill). Placing costs a try, made only when
        some nodes are reserved and the job found no room elsewhere."""
        held = [
            (holder, res)
            for holder, res in self.result.reservations.items()
            if holder != job.id and self.cap.hidden.issuperset(res.nodes)
        ]
        nodes = [i for _, res in held for i in res.nodes]
        self.cap.unhide(nodes)
        fits = self.place(self.cap, job) is not None
        self.cap.hide(nodes)
        if not fits:
            return reason
        shadows = [self.shadows.shadow(res, self.result.admitted, self.victims) for _, res in held]
        holders = [holder for holder, _ in held]
        return reasons.behind_reservations(
            reason, holders, shadows, self.now, self.policy.easy_backfill
        )

    def _backfill(self, job: Job) -> tuple[int, ...]:
        """Reserved nodes this job may use: it ends (its time limit) before their holders
        could start there (scheduling/backfill.py)."""
        if (
            not self.result.reservations
            or job.time_limit_s == math.inf
            or not self.policy.easy_backfill
        ):
            return ()
        return backfill_nodes(
            self.shadows,
            self.result.reservations,
            self.cap.hidden,
            self.result.admitted,
            self.victims,
            job.id,
            self.now + job.time_limit_s,
        )

    def _place(self, job: Job, backfill: tuple[int, ...] = ()) -> Placement | None:
        res = self.result.reservations.get(job.id)
        if res is not None and job.id in self.suspended:
            res = None  # its nodes are not hidden this cycle
        if res is not None:
            self.cap.unhide(res.nodes)
        if backfill:
            self.cap.unhide(backfill)
        placement = self.place(self.cap, job)
        if backfill:
            self.cap.hide(backfill)  # what it took there stays taken
        if res is not None and placement is None:
            self.cap.hide(res.nodes)
        return placement

    def _admit(self, job: Job, placement: Placement, preempts: tuple[str, ...] = ()) -> None:
        self.admitted_ids.add(job.id)
        floor = self.admitted_floor.get(job.team)
        if floor is None or job.rank < floor:
            self.admitted_floor[job.team] = job.rank
        self.cap.take_placement(placement, job.cpu, job.mem)
        self.quota.add(job.team, job.demand)
        if self.model_quotas:
            self.quota.add_models(job.team, gpus_by_model(self.snap.cluster, placement.replicas))
        # Its team's usage grew: more of its running jobs may be reclaimed now (it borrows, or
        # borrows more), so a search that failed may not fail again (seed 3240667649, under
        # kueue-tas: a reclaim after a borrower's admission took two of its team's jobs).
        self.no_plan.clear()
        self.result.admitted.append(Admit(job, placement, preempts))
        res = self.result.reservations.pop(job.id, None)
        if res is not None:
            self.cap.unhide(res.nodes)
            self.no_room.clear()  # capacity grew: what failed may fit now

    def _maybe_reserve(self, pending: Pending) -> None:
        job = pending.job
        reservations = self.result.reservations
        if (
            math.isinf(self.policy.starvation_s)
            or job.id in reservations
            or pending.since + self.policy.starvation_s > self.now
            or len(reservations) >= self.policy.max_reservations
        ):
            return
        taken = {i for r in reservations.values() for i in r.nodes}
        if self.model_quotas:
            job = self.within_models.narrowed(job)
        res = choose_reservation(self.cap, job, self.now, taken)
        if res is not None:
            reservations[job.id] = res
            self.cap.hide(res.nodes)

    def _wait_for_next_instant(self) -> None:
        """A job waits only for this instant to pass (its team lost a job of higher priority
        now). Any later cycle may admit it: the result says so, so that no shortcut takes a
        job queued before the wake-up as settling nothing (seed 1308851540, under kueue-tas:
        a submit 1 s later found the cycle skipped)."""
        self.result.until_next_instant = True
        self.wake(self.now + NEXT_INSTANT_S)

    def wake(self, t: float) -> None:
        """Ask for a cycle at `t`. A time not after now asks for nothing (this cycle already
        saw the state it names) and must not hide a later wake-up: a failed search's next victim
        already old enough set one, and the simulator never ran the cycle a later victim would
        have made possible (seed 1279166970); a service would have rerun at once, in vain."""
        if math.isinf(t) or t <= self.now:
            return
        if self.result.next_wakeup is None or t < self.result.next_wakeup:
            self.result.next_wakeup = t

    # -- phase 6: explain ------------------------------------------------------------------

    def explain_rest(self) -> None:
        if self.stopped_by is not None:
            for team in self.snap.queues:
                self.result.tail.setdefault(team, self.stopped_by)
