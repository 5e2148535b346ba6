"""Which victims a plan may take from each team (the rule that keeps a preemption from
spending a lending team's guarantee, `Released`), and the trial ledger a plan is checked on:
shared by every preemption search."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.capacity import Capacity
from scheduling.cohorts import below_common, parent_draw, reclaim_path_holds
from scheduling.jobs import Job, Placement, Running
from scheduling.models import gpus_by_model
from scheduling.quota import QuotaLedger
from scheduling.resources import ZERO, Resources
from scheduling.strategies import Placer


def below_nominal_after(used: tuple[int, int, int], release: Resources, nominal: Resources) -> bool:
    """True when a team using `used` that gives up `release` ends below its nominal somewhere:
    the one rule that keeps a preemption from taking a lending team's guarantee.

    GPUs count always: a victim team may never lose GPUs it holds within its nominal. CPUs and
    memory count only where the team is above its nominal: a team already below its nominal
    CPUs is not 'taken below' by losing more of them.
    """
    n, (ug, uc, um) = nominal, used  # plain ints (GPU, CPU, memory): a hot path
    return (
        (release.gpu > 0 and ug - release.gpu < n.gpu)
        or (release.cpu > 0 and uc > n.cpu and uc - release.cpu < n.cpu)
        or (release.mem > 0 and um > n.mem and um - release.mem < n.mem)
    )


def borrows_in(used: tuple[int, int, int], release: Resources, nominal: Resources) -> bool:
    """True when a team using `used` borrows what `release` frees: Kueue's test of a reclaim
    victim (its ClusterQueue is borrowing), which may leave the team below its nominal once
    the victim is gone. A victim that holds GPUs counts against the team's GPUs only (Kueue
    looks at the resources the preemptor lacks; on a GPU cluster those are GPUs), one that
    holds none against the CPUs or memory it frees."""
    n, (ug, uc, um) = nominal, used
    if release.gpu > 0:
        return ug > n.gpu
    return (release.cpu > 0 and uc > n.cpu) or (release.mem > 0 and um > n.mem)


def lends_back(quota: QuotaLedger, team: str, preemptor_team: str) -> bool:
    """May a reclaim by `preemptor_team` take `team`'s jobs at all, as the tree stands? In an
    organization tree, only if every cohort of `team` below the one the two share borrows
    from its parent (`cohorts.reclaim_path_holds`); always without a tree."""
    if not quota.tree:
        return True
    teams = quota.teams
    path = below_common(teams[team], teams[preemptor_team])
    used = quota.cohort_used
    return all(used.get(c.name, ZERO).gpu > c.quota.gpu for c in path)


class Released:
    """What a plan takes from each victim team so far. A victim may be taken only if its team
    stays at or above its nominal without it (`quota.below_nominal_after`), or, without
    `keep_nominal`, if its team is still borrowing (`quota.borrows_in`); with `subtrees`, in
    an organization tree, only if its cohorts below the one it shares with the preemptor's
    team borrow from their parents, and with `keep_nominal` keep their quotas without it
    (`cohorts.reclaim_path_holds`, Kueue's hierarchical reclaim, `Policy.tree_reclaim`). The
    preemptor's own team aside, whose lower-priority jobs it may preempt whatever its usage."""

    __slots__ = ("_keep", "_less", "_preemptor", "_quota", "_subtrees", "_taken")

    def __init__(
        self,
        quota: QuotaLedger,
        preemptor_team: str,
        keep_nominal: bool = True,
        subtrees: bool = False,
    ) -> None:
        self._quota = quota
        self._preemptor = preemptor_team
        self._keep = keep_nominal
        self._subtrees = subtrees and quota.tree
        self._taken: dict[str, tuple[int, int, int]] = {}
        self._less: dict[str, int] = {}  # cohort -> GPUs its usage lost to the plan so far

    def take(self, victim: Job) -> bool:
        """Count `victim` in the plan and say True, or say False (and count nothing)."""
        team, d = victim.team, victim.demand
        tg, tc, tm = self._taken.get(team, (0, 0, 0))  # ints: millions of calls on a replay
        drops = None
        if team != self._preemptor:
            quota = self._quota
            u = quota.usage[team]
            left = (u.gpu - tg, u.cpu - tc, u.mem - tm)
            nominal = quota.teams[team].nominal
            if self._keep:
                if below_nominal_after(left, d, nominal):
                    return False
            elif not borrows_in(left, d, nominal):
                return False
            if self._subtrees and d.gpu > 0:
                drops = self._tree_drops(team, left[0], d.gpu)
                if drops is None:
                    return False
        self._taken[team] = (tg + d.gpu, tc + d.cpu, tm + d.mem)
        if drops:
            for name, gpus in drops:
                self._less[name] = self._less.get(name, 0) + gpus
        return True

    def _tree_drops(self, team: str, left: int, gpus: int) -> list[tuple[str, int]] | None:
        teams, less = self._quota.teams, self._less
        path = below_common(teams[team], teams[self._preemptor])
        if not path:
            return []
        cohort_used = self._quota.cohort_used
        used = {c.name: cohort_used.get(c.name, ZERO).gpu - less.get(c.name, 0) for c in path}
        g = teams[team].guaranteed.gpu
        before, after = parent_draw(left, g), parent_draw(left - gpus, g)
        return reclaim_path_holds(path, used, before, after, self._keep)


def trial_without(quota: QuotaLedger, victims: Sequence[Running], cap: Capacity) -> QuotaLedger:
    """A trial ledger with the victims gone: their demand, and where teams declare per-model
    quotas their GPUs of each model (victims may free a model's pool that the job needs)."""
    trial = quota.without(v.job for v in victims)
    if quota.has_models:
        for v in victims:
            trial.remove_models(v.job.team, gpus_by_model(cap.cluster, v.placement.replicas))
    return trial


def place_on(place: Placer, cap: Capacity, quota: QuotaLedger, job: Job) -> Placement | None:
    """`place(cap, job)` with the trial ledger `quota`, for a placer that reads one (the
    per-model quotas' narrowing, `model_quotas.ModelQuotaPlacer`)."""
    on_ledger = getattr(place, "on_ledger", None)
    return place(cap, job) if on_ledger is None else on_ledger(quota)(cap, job)
