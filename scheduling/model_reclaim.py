"""Reclaim per GPU model: a team takes back what it lent of a model's nominal.

A governed model (one some team declares a `gpus.<MODEL>` key for, `quota.model_quotas`) is lent
and borrowed through its own pool. A job that fits its team's nominal of a model and its total
nominal, but that the model's pool has no room for because other teams borrow the model, may
preempt their jobs on that model, as a job within its team's nominal GPUs reclaims borrowed
GPUs (preemption.py): victims of teams that use more of the model than their nominal of it, the
cheapest losses first (the lenders' guards, `VictimPool.reclaimable`), none that would take its
team below its nominal of the model (`Policy.victim_keeps_nominal`; else its team need only be
borrowing the model when it is taken). The plan holds when the job then fits its team's quotas,
the total and the model's, and a placement on the model's nodes; victims it does not need are
put back. A MIG profile's `mig.<profile>` key is reclaimed the same way (decision 0024): its
victims are other teams' jobs holding instances of the profile, counted by instance, and the
job is placed anywhere its other keys allow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

from scheduling.capacity import Capacity
from scheduling.cluster import Cluster
from scheduling.decisions import PreemptionPlan
from scheduling.jobs import Job, Placement, Running
from scheduling.model_quotas import ModelQuotaPlacer
from scheduling.models import gpus_by_model, key_amount, mig_key
from scheduling.quota import MIG_KEY, QuotaLedger
from scheduling.strategies import Placer
from scheduling.victims import VictimPool

_NO_FLOOR = 1 << 62


def reclaimable_models(quota: QuotaLedger, cluster: Cluster, job: Job) -> list[str]:
    """The models the job accepts (in its order) that its team's nominal of has room for (all
    of the job counted there) while another team uses more of it than its own nominal; none
    if the job would take its team above its total nominal. A reclaim keeps both nominals:
    a team borrowing in total that reclaimed a model from a team within its total would lose the
    job to that team's reclaim of the totals, and so on for ever (found by the quality
    benchmark's models-quota family under kueue-tas, which has no delay or guards)."""
    if not quota.fits_nominal_with(job.team, job.demand):
        return []
    declared = quota.declared_models(job.team)
    out = []
    key = mig_key(job)
    for model in (*((key,) if key else ()), *(job.gpu_models or cluster.models)):
        q = declared.get(model)
        amount = key_amount(job, model)
        if q is None or quota.model_usage.get((job.team, model), 0) + amount > q.nominal:
            continue
        if any(
            quota.model_usage.get((team, model), 0) > quota.declared_models(team)[model].nominal
            for team in quota.teams
            if team != job.team
        ):
            out.append(model)
    return out


def plan_model_reclaim(
    pool: VictimPool,
    cap: Capacity,
    quota: QuotaLedger,
    job: Job,
    model: str,
    *,
    place: Placer,
    guarded: bool,
    excluded: set[str],
    spared_above: Mapping[str, int],
    keep_nominal: bool,
    max_candidates: int,
) -> PreemptionPlan | None:
    """Victims on `model` and the placement on its nodes they make room for, or None. Does not
    change `cap` or `quota`. An unguarded search that fails runs again within the guards (the
    greedy prefix is not monotone in its candidates), as `preemption.plan_preemption` does."""
    ask = _Ask(pool, cap, quota, job, model, place, excluded, spared_above, keep_nominal)
    for within_guards in (True,) if guarded else (False, True):
        plan = _search(ask, within_guards, max_candidates)
        if plan is not None:
            return plan
    return None


class _Ask(NamedTuple):
    pool: VictimPool
    cap: Capacity
    quota: QuotaLedger
    job: Job
    model: str
    place: Placer
    excluded: set[str]
    spared_above: Mapping[str, int]
    keep_nominal: bool


def _search(ask: _Ask, guarded: bool, max_candidates: int) -> PreemptionPlan | None:
    pool, cap, quota, job, model, place, excluded, spared_above, keep_nominal = ask
    cluster = cap.cluster
    on_model = (
        job if model.startswith(MIG_KEY) else replace(job, gpu_models=(model,), mixed_models=False)
    )
    candidates: list[tuple[Running, int]] = []
    for team in sorted(quota.teams):
        if team == job.team:
            continue
        nominal = quota.declared_models(team)[model].nominal
        if quota.model_usage.get((team, model), 0) <= nominal:
            continue
        floor = spared_above.get(team, _NO_FLOOR)
        for r in pool.reclaimable(team, guarded):
            if r.job.id in excluded or r.job.rank > floor:
                continue
            held = gpus_by_model(cluster, r.placement.replicas).get(model, 0)
            if held:
                candidates.append((r, held))
    candidates.sort(key=lambda c: pool.loss_key(c[0]))
    # The prefix in loss order, each victim against its team's use of the model.
    left = {team: quota.model_usage.get((team, model), 0) for team in quota.teams}
    taken: list[Running] = []
    placement = None
    for r, held in candidates[:max_candidates]:
        team = r.job.team
        nominal = quota.declared_models(team)[model].nominal
        if left[team] <= nominal or (keep_nominal and left[team] - held < nominal):
            continue  # it no longer borrows the model, or would end below its nominal of it
        left[team] -= held
        taken.append(r)
        placement = _room(cap, quota, on_model, model, taken, place)
        if placement is not None:
            break
    if placement is None:
        return None
    # Put back every victim the job can do without, the costliest first.
    for victim in sorted(taken[:-1], key=lambda r: (-r.job.rank, r.start_time)):
        rest = [r for r in taken if r is not victim]
        found = _room(cap, quota, on_model, model, rest, place)
        if found is not None:
            taken, placement = rest, found
    return PreemptionPlan(placement, tuple(taken))


def _room(
    cap: Capacity, quota: QuotaLedger, job: Job, model: str, victims: list[Running], place: Placer
) -> Placement | None:
    """The job's placement with `victims` gone, if its team's quotas (the total, `model`'s and
    every other per-model key it counts in) then hold it; else None."""
    trial = quota.without(v.job for v in victims)
    for v in victims:
        trial.remove_models(v.job.team, gpus_by_model(cap.cluster, v.placement.replicas))
    if trial.check(job.team, job.demand, job.preemptible) is not None:
        return None
    if trial.model_problem(job.team, model, key_amount(job, model), job.preemptible) is not None:
        return None
    room = cap.clone()
    for v in victims:
        room.give_placement(v.placement, v.job.cpu, v.job.mem)
    # On the models its team's other keys leave it (a MIG profile's reclaim places the job
    # on any model whose key has room; a model's reclaim needs room in its MIG profile's key).
    return ModelQuotaPlacer(trial, cap.cluster, place)(room, job)


def next_victim_at(pool: VictimPool, quota: QuotaLedger, job: Job, model: str) -> float | None:
    """After a failed search: when the first job on `model` of a team that borrows it passes
    its minimum run time (then more victims may be allowed), or None."""
    cluster = pool.snapshot.cluster
    for r in pool.upcoming:  # in start order
        team = r.job.team
        if team == job.team or not r.job.preemptible:
            continue
        nominal = quota.declared_models(team)[model].nominal
        if quota.model_usage.get((team, model), 0) <= nominal:
            continue
        if gpus_by_model(cluster, r.placement.replicas).get(model):
            return r.start_time + pool.min_runtime_s
    return None
