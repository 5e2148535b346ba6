"""The cycle's preemption steps: when a job may preempt, its search, and admitting it with
its victims; and the per-model reclaim of a job that waits on a model's key.

A part of `cycle.Cycle` (its base class), apart only to keep each module readable: the steps
read and change the cycle in progress, as its other phases do. What a preemption may take, and
how the victims are found, is `scheduling/preemption.py` and `scheduling/model_reclaim.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from scheduling import reasons
from scheduling.decisions import PendingReason, Preempt, Status
from scheduling.model_reclaim import next_victim_at, plan_model_reclaim, reclaimable_models
from scheduling.models import gpus_by_model, key_amount, mig_key
from scheduling.preemption import PreemptionPlan, plan_preemption
from scheduling.victim_rules import lends_back
from scheduling.victims import VictimPool

if TYPE_CHECKING:
    from scheduling.backfill import Shadows
    from scheduling.capacity import Capacity
    from scheduling.decisions import CycleResult
    from scheduling.jobs import Job, Pending, Placement, Running
    from scheduling.model_quotas import ModelQuotaPlacer
    from scheduling.ordering import Candidates
    from scheduling.policy import Policy
    from scheduling.quota import QuotaLedger, QuotaProblem
    from scheduling.snapshot import Snapshot
    from scheduling.strategies import Placer
    from scheduling.victim_index import NodeIndex


class PreemptionSteps:
    """What `cycle.Cycle` does to make room by preemption (see the module docstring)."""

    # The cycle's state these steps read and change (set by `Cycle.__init__`).
    snap: Snapshot
    policy: Policy
    now: float
    fast: bool
    cap: Capacity
    quota: QuotaLedger
    result: CycleResult
    place: Placer | ModelQuotaPlacer
    model_quotas: bool
    no_room: dict
    no_plan: dict[tuple, list[tuple[int, int, int, bool]]]
    admitted_floor: dict[str, int]
    preempted_ceiling: dict[str, int]
    victim_pool: VictimPool | None
    node_indexes: dict[tuple, NodeIndex]
    next_victim: Running | None
    searches: dict[tuple[str, bool], int]
    victims: set[str]
    running_floor: dict[str, int | None]
    shadows: Shadows

    def wake(self, t: float) -> None:
        raise NotImplementedError

    def _admit(self, job: Job, placement: Placement, preempts: tuple[str, ...] = ()) -> None:
        raise NotImplementedError

    def _may_preempt(self, pending: Pending) -> float | None:
        """When the job may preempt: now or later (its preemption delay); None: never as
        things stand: it may neither reclaim (its team below nominal with it, another team
        borrowing) nor preempt a lower priority running in its team (preemption.py)."""
        if not self.policy.preemption:
            return None
        job = pending.job
        team = job.team
        quota = self.quota
        if not self.policy.preempts_beyond_nominal and job.demand.first_excess(
            quota.teams[team].nominal
        ):
            return None  # Kueue's rule: a job bigger than its team's nominal never preempts
        if not (quota.fits_nominal_with(team, job.demand) and quota.any_borrowing(team)):
            # The team's lowest running priority is read once per cycle (this runs for
            # every job that waits): the snapshot's running jobs do not change within one.
            floor = self.running_floor.get(team, _UNKNOWN)
            if floor is _UNKNOWN:
                floor = self.running_floor[team] = _lowest(self.snap.running_priorities, team)
            if floor is None or floor >= job.rank:
                return None
        # Waiting a little often beats killing work: turnover frees room without a restart.
        allowed_at = pending.since + self.policy.preemption_delay_s
        if allowed_at > self.now:
            self.wake(allowed_at)
        return allowed_at

    def _reclaims(self, job: Job) -> bool:
        return self.quota.fits_nominal_with(job.team, job.demand) and self.quota.any_borrowing(
            job.team
        )

    def _reclaim_reason(self, job: Job, problem: QuotaProblem, allowed_at: float) -> PendingReason:
        v = self.next_victim
        next_at = None if v is None else (v, v.start_time + self.policy.min_runtime_s)
        q = self.quota
        # Under the strict hierarchical reclaim, the borrowers whose cohorts lend back to it
        # (the others' departments hold what they use).
        strict = q.tree and self.policy.tree_reclaim == "strict"
        lenders = {t for t in q.borrowers if lends_back(q, t, job.team)} if strict else q.borrowers
        return reasons.reclaim(
            job, problem, q.usage, q.teams, lenders, self.now, allowed_at, next_at
        )

    def _plan_preemption(self, pending: Pending) -> PreemptionPlan | None:
        job = pending.job
        # Reclaim takes only victims within the guards, until the job has waited
        # reclaim_deadline_s: then any borrowed job (the bound of the guarantee).
        unguarded_at = pending.since + self.policy.reclaim_deadline_s
        guarded = unguarded_at > self.now
        if guarded:
            self.wake(unguarded_at)
        # A failed plan for a job means no plan for one of the same team, priority, topology
        # and replicas that needs as much of every resource or more per replica, until the
        # cycle admits a job (it clears them: its team may then lend less or borrow more),
        # and that may take no more victims: a guarded search
        # after a failed unguarded one, or one of the same kind (the guarded victims are some
        # of the unguarded ones). Those searches are skipped, and cost no search budget in
        # either mode: otherwise EXACT, which runs them, would spend a budget that FAST, whose
        # closed classes never reach them, keeps for a later job (a difference the property
        # test found: a copy of a job waiting less than the deadline took the last search).
        # Preemptibility is in the key: a non-preemptible job may not borrow, so its failure
        # says nothing of a preemptible one's (seed 2904074779: a non-preemptible 4-GPU job's
        # failed search skipped a preemptible 5-GPU one's, which EXACT found a plan for).
        key = (
            job.team, job.rank, job.topology, job.shared, job.replicas, job.preemptible,
            job.gpu_models, job.mixed_models, job.mig,
        )  # fmt: skip
        known_to_fail = any(
            job.gpu >= g and job.cpu >= c and job.mem >= m and (guarded or not was_guarded)
            for g, c, m, was_guarded in self.no_plan.get(key, ())
        )
        if known_to_fail and self.fast:
            return None
        # Priority preemption: a team's first searches in a cycle
        # (max_preemption_searches_per_team), as each costs milliseconds on a big cluster.
        # Reclaim: as many as its jobs within nominal need (reclaim_searches_per_team, 0 in
        # berth), or a job with no plan would keep the small one behind it from its nominal;
        # the skip above and the closing of failed classes bound their number.
        reclaims = self._reclaims(job)
        budget = (job.team, reclaims)
        tried = self.searches.get(budget, 0)
        if reclaims:
            limit = self.policy.reclaim_searches_per_team
        else:
            limit = self.policy.max_preemption_searches_per_team
        if limit and tried >= limit and not known_to_fail:
            return None
        if not known_to_fail:  # one known to fail is not run at all in FAST: it costs nothing
            self.searches[budget] = tried + 1
        if reclaims and not self.policy.victim_keeps_nominal and self.quota.has_models:
            job = _on_models_within_nominal(self.quota, self.snap.cluster.models, job)
            if job is None:
                return None
        plan = plan_preemption(
            self._victim_pool(),
            self.cap,
            self.quota,
            job,
            excluded=self.victims,
            max_candidates=self.policy.max_preemption_candidates,
            spared_above=self.admitted_floor,
            place=self.place,
            guarded=guarded,
            indexes=self.node_indexes if self.fast else None,
            keep_nominal=self.policy.victim_keeps_nominal,
            tree_reclaim=self.policy.tree_reclaim,
        )
        if plan is None:
            self.no_plan.setdefault(key, []).append((job.gpu, job.cpu, job.mem, guarded))
            self.next_victim = self._victim_pool().next_eligible(
                self.cap, self.quota, job.team, self.policy.tree_reclaim == "strict"
            )
            if self.next_victim is not None:  # more victims may be allowed then
                self.wake(self.next_victim.start_time + self.policy.min_runtime_s)
        return plan

    def _victim_pool(self) -> VictimPool:
        """The cycle's victims (made on the first preemption attempt)."""
        if self.victim_pool is None:
            self.victim_pool = VictimPool(
                self.snap,
                self.policy.min_runtime_s,
                self.policy.max_preemptions,
                self.policy.max_victim_runtime_s,
                self.policy.checkpoint_aware,
                saved_guards=self.policy.las,
            )
        return self.victim_pool

    def _admit_with_preemption(
        self, job: Job, plan: PreemptionPlan, candidates: Candidates
    ) -> None:
        for victim in plan.victims:
            v = victim.job
            self.cap.give_placement(victim.placement, v.cpu, v.mem)
            self.quota.remove(v.team, v.demand)
            if self.model_quotas:
                by_model = gpus_by_model(self.snap.cluster, victim.placement.replicas)
                self.quota.remove_models(v.team, by_model)
            self.victims.add(v.id)
            self.result.preempted.append(Preempt(v.id, job.id))
            if v.rank > self.preempted_ceiling.get(v.team, v.rank - 1):
                self.preempted_ceiling[v.team] = v.rank
            candidates.changed(v.team)
        self._admit(job, plan.placement, tuple(v.job.id for v in plan.victims))
        # Capacity grew beyond what the preemptor took: what failed may fit now, and a search
        # that failed may not fail again. Classes closed earlier stay closed until the next
        # cycle, which runs at once after one that changed anything.
        self.no_room.clear()
        self.no_plan.clear()
        self.shadows.forget()  # the victims on reserved nodes end now, not at their limits

    def _reclaim_model(
        self, pending: Pending, candidates: Candidates, reason: PendingReason
    ) -> tuple[Status, PendingReason | None]:
        """A job that waits on a model's key: within its team's nominal of a model that
        another team borrows, it may take it back (scheduling/model_reclaim.py), after its
        preemption delay, within the guards until its reclaim deadline."""
        found = self._try_model_reclaim(pending, candidates)
        if found is None:
            return Status.BLOCKED, reason
        return (Status.PREEMPTS, None) if found else (Status.NEEDS_PREEMPTION, reason)

    def _try_model_reclaim(self, pending: Pending, candidates: Candidates) -> bool | None:
        """`_reclaim_model`'s search: True if the job was admitted with its victims, False if
        it may reclaim a model but not now (the wake-ups asked for), None if it may not."""
        if not self.policy.preemption:
            return None
        # Only what the job would hold within every nominal it counts in: a job that would
        # borrow its MIG profile or its model is no lender owed, and were it to reclaim
        # another key, the team it took from could reclaim back the key it borrows, for ever
        # (a fresh-example hunt, seed 3525431822: a profile's key and a model's key over the
        # same instance; tests/data/livelocks_fixed/).
        job = _on_models_within_nominal(self.quota, self.snap.cluster.models, pending.job)
        models = reclaimable_models(self.quota, self.snap.cluster, job) if job else []
        if job is None or not models:
            return None
        allowed_at = pending.since + self.policy.preemption_delay_s
        if allowed_at > self.now:
            self.wake(allowed_at)
            return False
        unguarded_at = pending.since + self.policy.reclaim_deadline_s
        guarded = unguarded_at > self.now
        if guarded:
            self.wake(unguarded_at)
        for model in models:  # in the job's order: the first that a plan makes room on
            plan = plan_model_reclaim(
                self._victim_pool(),
                self.cap,
                self.quota,
                job,
                model,
                place=self.policy.placement,
                guarded=guarded,
                excluded=self.victims,
                spared_above=self.admitted_floor,
                keep_nominal=self.policy.victim_keeps_nominal,
                max_candidates=self.policy.max_preemption_candidates,
            )
            if plan is not None:
                self._admit_with_preemption(job, plan, candidates)
                return True
            later = next_victim_at(self._victim_pool(), self.quota, job, model)
            if later is not None:
                self.wake(later)
        return False


_UNKNOWN = object()


def _on_models_within_nominal(quota: QuotaLedger, models: Sequence[str], job: Job) -> Job | None:
    """Under Kueue's victim rule (`Policy.victim_keeps_nominal` off), a reclaim of the totals
    lands only where the job stays within its team's nominal of the model, as a Kueue workload
    reclaims only within its ClusterQueue's nominal quota of the flavor it is assigned: the job
    narrowed to such models (a model no team declares a key for counts as within), or None.
    Else a team within its total nominal that reclaims onto a model it then borrows loses the
    job to the model's reclaim by the team it took the GPUs from (which Kueue's rule let it take
    below its nominal), and so on at one instant for ever (found by a fresh-example hunt, seed
    2635410150; tests/test_model_quotas.py). With the rule on, the totals' reclaim never takes
    a team below its nominal, and a model's reclaim keeps its team within it: no such cycle.
    The same holds for a MIG job's profile key (`mig.<profile>`): above its team's nominal of
    it, no reclaim of the totals (None)."""
    declared = quota.declared_models(job.team)
    key = mig_key(job)
    if key in declared and (
        quota.model_usage.get((job.team, key), 0) + key_amount(job, key) > declared[key].nominal
    ):
        return None
    kept = tuple(
        m
        for m in job.gpu_models or models
        if m not in declared
        or quota.model_usage.get((job.team, m), 0) + job.demand.gpu <= declared[m].nominal
    )
    if kept == (job.gpu_models or tuple(models)):
        return job
    return replace(job, gpu_models=kept) if kept else None


def _lowest(running_priorities: Mapping[str, Counter], team: str) -> int | None:
    priorities = running_priorities.get(team)
    return min(priorities) if priorities else None
