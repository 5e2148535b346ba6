"""Team quotas: nominal (guaranteed), borrowing and lending, in a tree of cohorts.

The model follows Kueue's cohorts. Each team's nominal quota is split into a guaranteed part
(nominal - lending_limit), which only it may use, and a lendable part, which goes into a pool
shared by the cohort. A team may use its guaranteed part plus whatever of the pool is free, up to
nominal + borrowing_limit. Usage above nominal is *borrowed*: it may be reclaimed by preemption
when its lender wants it back.

Teams may sit in an organization tree (`scheduling/cohorts.py`): unused quota is then lent
first inside the closest cohort, then further up, within every level's limits. Without
cohorts every team is a child of the one cohort of all teams, the flat pool above, at no cost.

Resources a team's nominal does not mention are not limited by quota (only by the cluster).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduling.cohorts import Cohort, capped, carry_up, cohort_pool, grown_past, parent_draw
from scheduling.resources import UNLIMITED, ZERO, Resources

if TYPE_CHECKING:
    from scheduling.jobs import Job


MIG_KEY = "mig."  # `mig.<profile>`: a team's quota of one MIG profile's instances


def quota_key(model: str) -> str:
    """The teams-file key of a per-model quota: `gpus.<MODEL>`, or a MIG profile's
    `mig.<profile>` (held in the same tables as a model named `mig.<profile>`)."""
    return model if model.startswith(MIG_KEY) else f"gpus.{model}"


@dataclass(frozen=True, slots=True)
class ModelQuota:
    """A team's quota of one GPU model (`gpus.<MODEL>` keys), in milli-GPUs, or of one MIG
    profile (`mig.<profile>` keys, `model` named so), in thousandths of an instance: enforced
    beside the model-agnostic quota, with a lending pool per key (`model_quotas`)."""

    model: str
    nominal: int
    borrowing_limit: int = UNLIMITED
    lending_limit: int | None = None  # None: all of nominal
    guaranteed: int = field(init=False, repr=False, compare=False)
    ceiling: int = field(init=False, repr=False, compare=False)
    lends: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lends = self.nominal if self.lending_limit is None else self.lending_limit
        object.__setattr__(self, "lends", min(lends, UNLIMITED))
        object.__setattr__(self, "guaranteed", max(self.nominal - lends, 0))
        object.__setattr__(self, "ceiling", min(self.nominal + self.borrowing_limit, UNLIMITED))


@dataclass(frozen=True, slots=True)
class Team:
    """A team's quota. Unset limits are UNLIMITED (borrowing) or all of nominal (lending)."""

    name: str
    nominal: Resources
    borrowing_limit: Resources
    lending_limit: Resources
    weight: float = 1.0
    models: tuple[ModelQuota, ...] = ()  # per GPU model, where the team declares any key
    # Its cohorts, the closest first, up to a top-level one (empty: a child of the cohort of
    # all teams, the tree's root, which has no limits of its own).
    cohorts: tuple[Cohort, ...] = ()
    # Derived once (every submission asks): the part only this team may use, the most it
    # may ever use (nominal + borrowing limit), and what it puts into the cohort's pool.
    guaranteed: Resources = field(init=False, repr=False, compare=False)
    ceiling: Resources = field(init=False, repr=False, compare=False)
    lends: Resources = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "guaranteed", (self.nominal - self.lending_limit).clamp_low())
        object.__setattr__(self, "ceiling", capped(self.nominal + self.borrowing_limit))
        object.__setattr__(self, "lends", capped(self.lending_limit))


@dataclass(frozen=True, slots=True)
class QuotaProblem:
    """Why a request does not fit a team's quota right now."""

    resource: str  # gpus | cpus | memory_gb
    # borrowing_limit | cohort (the root's pool) | nominal_non_preemptible | cohort_limit:<name>
    # (a cohort of the tree would exceed its quota + borrowing limit)
    limit: str

    def message(self, team: str) -> str:
        if self.limit.startswith(COHORT_LIMIT):
            cohort = self.limit[len(COHORT_LIMIT) :]
            return (
                f"cohort {cohort} (of team {team}) would exceed its quota + borrowing_limit for "
                f"{self.resource}: its teams use what it has and may borrow"
            )
        if self.limit == "borrowing_limit":
            return f"team {team} would exceed nominal + borrowing_limit for {self.resource}"
        if self.limit == "nominal_non_preemptible":
            return (
                f"team {team} would exceed its nominal {self.resource}, and a non-preemptible "
                "job may not borrow"
            )
        return f"the cohort has no idle {self.resource} left to lend to team {team}"


COHORT_LIMIT = "cohort_limit:"
_NO_MODELS: Mapping[str, ModelQuota] = {}


def model_quotas(
    teams: Mapping[str, Team], model_gpus: Mapping[str, int]
) -> tuple[dict[str, dict[str, ModelQuota]], dict[str, int]]:
    """Per team, its quota of every *governed* model (one that some team declares a
    `gpus.<MODEL>` key for), and each governed model's lending pool (milli-GPUs).

    Once one team declares a model, every team's use of it counts: a team that declares no key
    for it has a nominal of 0 and no borrowing limit, so it uses the model by borrowing from the
    pool, within its `gpus`. The pool holds what the declaring teams lend and what of the
    model's GPUs (`model_gpus`, the cluster's) no team's nominal claims. So what a team does not
    lend of its nominal (`lending_limit`) no other team can ever take."""
    governed = sorted({q.model for t in teams.values() for q in t.models})
    if not governed:
        return {}, {}
    per_team: dict[str, dict[str, ModelQuota]] = {}
    for name, t in teams.items():
        own = {q.model: q for q in t.models}
        per_team[name] = {m: own.get(m) or ModelQuota(m, 0) for m in governed}
    pools = {}
    for m in governed:
        claimed = sum(per_team[n][m].nominal for n in teams)
        lent = sum(per_team[n][m].lends for n in teams)
        pools[m] = min(lent + max(model_gpus.get(m, 0) - claimed, 0), UNLIMITED)
    return per_team, pools


# `check` runs for every examined job: it hands out these instead of building a new one each time.
_PROBLEMS = {
    (resource, limit): QuotaProblem(resource, limit)
    for resource in ("gpus", "cpus", "memory_gb")
    for limit in ("borrowing_limit", "cohort", "nominal_non_preemptible")
}


class QuotaLedger:
    """Usage per team and of the cohort's lending pool; cheap to clone for a cycle's scratch.

    The methods a cycle calls for every job (`check`, `add`) work on plain ints: they run
    millions of times in a trace replay, and building Resources for each step doubled their
    cost. `borrowers` is kept in step so that "is anyone borrowing?" costs nothing.
    """

    __slots__ = (
        "_ceiling",
        "_guaranteed",
        "_members",
        "_models",
        "_nominal",
        "_paths",
        "borrowers",
        "cohort_used",
        "model_pool_capacity",
        "model_pool_used",
        "model_usage",
        "pool_capacity",
        "pool_used",
        "teams",
        "usage",
    )

    def __init__(
        self, teams: Mapping[str, Team], model_gpus: Mapping[str, int] | None = None
    ) -> None:
        """`model_gpus`: the cluster's GPUs per model (milli), for the pools of the models
        that teams declare quotas for (`model_quotas`)."""
        self.teams = teams
        self.usage: dict[str, Resources] = {name: ZERO for name in teams}
        self._guaranteed = {name: t.guaranteed for name, t in teams.items()}
        self._ceiling = {name: t.ceiling for name, t in teams.items()}
        self._nominal = {name: t.nominal for name, t in teams.items()}
        self.pool_capacity = cohort_pool(teams)
        self.pool_used = ZERO
        self.borrowers: set[str] = set()  # teams using more than their nominal of something
        # The organization tree: each team's cohorts (closest first), and what each cohort's
        # children draw on its pool. Empty without cohorts: the flat pool alone.
        self._paths = {name: t.cohorts for name, t in teams.items() if t.cohorts}
        self.cohort_used: dict[str, Resources] = {}
        members: dict[str, list[str]] = {}  # cohort -> the teams under it, at any depth
        for name, path in self._paths.items():
            for c in path:
                members.setdefault(c.name, []).append(name)
        self._members = {c: tuple(m) for c, m in members.items()}
        # Per-model quotas (`gpus.<MODEL>` keys): every team's quota of each governed model,
        # its usage of it (milli-GPUs) and each such model's lending pool (`model_quotas`).
        # Empty for most clusters: then nothing below costs anything.
        self._models, self.model_pool_capacity = model_quotas(teams, model_gpus or {})
        self.model_usage: dict[tuple[str, str], int] = {}
        self.model_pool_used: dict[str, int] = {}

    def clone(self) -> QuotaLedger:
        new = object.__new__(QuotaLedger)
        new.teams = self.teams
        new.usage = dict(self.usage)
        new._guaranteed = self._guaranteed
        new._ceiling = self._ceiling
        new._nominal = self._nominal
        new.pool_capacity = self.pool_capacity
        new.pool_used = self.pool_used
        new.borrowers = set(self.borrowers)
        new._paths = self._paths
        new._members = self._members
        new.cohort_used = dict(self.cohort_used) if self._paths else self.cohort_used
        new._models = self._models
        new.model_pool_capacity = self.model_pool_capacity
        # Copied only where some team declares a model (else never written: with no governed
        # model, `add_models` has nothing to count).
        new.model_usage = dict(self.model_usage) if self._models else self.model_usage
        new.model_pool_used = dict(self.model_pool_used) if self._models else self.model_pool_used
        return new

    # -- per-model quotas ----------------------------------------------------------------------

    @property
    def has_models(self) -> bool:
        """Does any team declare a per-model quota?"""
        return bool(self._models)

    def declared_models(self, team: str) -> Mapping[str, ModelQuota]:
        """The team's quotas of the governed models (empty where no team declares any: then
        every team uses any model within its `gpus`)."""
        return self._models.get(team, _NO_MODELS)

    def model_problem(
        self, team: str, model: str, gpu: int, preemptible: bool = True
    ) -> QuotaProblem | None:
        """None when `gpu` milli-GPUs more of `model` fit the team's quota of that model (or no
        team declares one), else the first limit they break: as `check`, on one model's key."""
        q = self._models.get(team, _NO_MODELS).get(model)
        if q is None:
            return None
        used = self.model_usage.get((team, model), 0)
        after = used + gpu
        key = quota_key(model)
        if after > q.ceiling:
            return QuotaProblem(key, "borrowing_limit")
        if not preemptible and after > q.nominal:
            return QuotaProblem(key, "nominal_non_preemptible")
        g = q.guaranteed
        if after > g:
            pool = self.model_pool_used.get(model, 0) + (after - g) - max(used - g, 0)
            if pool > self.model_pool_capacity.get(model, 0):
                return QuotaProblem(key, "cohort")
        return None

    def add_models(self, team: str, by_model: Mapping[str, int]) -> None:
        """A job of the team now holds `by_model` (model -> milli-GPUs): counted against the
        governed models."""
        self._change_models(team, by_model, 1)

    def remove_models(self, team: str, by_model: Mapping[str, int]) -> None:
        self._change_models(team, by_model, -1)

    def _change_models(self, team: str, by_model: Mapping[str, int], sign: int) -> None:
        declared = self._models.get(team)
        if not declared:
            return
        for model, gpu in by_model.items():
            q = declared.get(model)
            if q is None:
                continue
            key = (team, model)
            before = self.model_usage.get(key, 0)
            after = before + sign * gpu
            self.model_usage[key] = after
            g = q.guaranteed
            self.model_pool_used[model] = (
                self.model_pool_used.get(model, 0) + max(after - g, 0) - max(before - g, 0)
            )

    def check(self, team: str, request: Resources, preemptible: bool = True) -> QuotaProblem | None:
        """None when `request` fits the team's quota now, else the first limit it breaks."""
        u = self.usage[team]
        ag, ac, am = u.gpu + request.gpu, u.cpu + request.cpu, u.mem + request.mem
        problem = self._own_limits(team, ag, ac, am, preemptible)
        if problem is not None:
            return problem
        # The team's draw on the lending pool: what it uses beyond its guaranteed part.
        g, used, cap = self._guaranteed[team], self.pool_used, self.pool_capacity
        gg, gc, gm = g.gpu, g.cpu, g.mem
        path = self._paths.get(team) if self._paths else None
        if path:
            return self._tree_problem(path, u, g, ag, ac, am)
        if ag > gg and used.gpu + (ag - gg) - (u.gpu - gg if u.gpu > gg else 0) > cap.gpu:
            return _PROBLEMS["gpus", "cohort"]
        if ac > gc and used.cpu + (ac - gc) - (u.cpu - gc if u.cpu > gc else 0) > cap.cpu:
            return _PROBLEMS["cpus", "cohort"]
        if am > gm and used.mem + (am - gm) - (u.mem - gm if u.mem > gm else 0) > cap.mem:
            return _PROBLEMS["memory_gb", "cohort"]
        return None

    def _tree_problem(
        self,
        path: tuple[Cohort, ...],
        u: Resources,
        g: Resources,
        ag: int,
        ac: int,
        am: int,
    ) -> QuotaProblem | None:
        """`check` for a team in cohorts: its draw's change, carried up its cohorts (each
        holds its teams' use up to its guaranteed part, and draws the rest on its parent's
        pool), breaks no cohort's quota + borrowing limit and fits the root's pool."""
        d = Resources(
            parent_draw(ag, g.gpu) - parent_draw(u.gpu, g.gpu),
            parent_draw(ac, g.cpu) - parent_draw(u.cpu, g.cpu),
            parent_draw(am, g.mem) - parent_draw(u.mem, g.mem),
        )
        steps, d = carry_up(path, self.cohort_used, d)
        for c, before, after in steps:
            over = grown_past(before, after, c.ceiling)
            if over:
                return QuotaProblem(over, COHORT_LIMIT + c.name)
        over = grown_past(self.pool_used, self.pool_used + d, self.pool_capacity)
        return None if over is None else _PROBLEMS[over, "cohort"]

    def _own_limits(
        self, team: str, ag: int, ac: int, am: int, preemptible: bool
    ) -> QuotaProblem | None:
        """The first of the team's own limits that a usage of (ag, ac, am) breaks: its
        ceiling, and its nominal for a non-preemptible request."""
        c = self._ceiling[team]
        if ag > c.gpu:
            return _PROBLEMS["gpus", "borrowing_limit"]
        if ac > c.cpu:
            return _PROBLEMS["cpus", "borrowing_limit"]
        if am > c.mem:
            return _PROBLEMS["memory_gb", "borrowing_limit"]
        if not preemptible:
            n = self._nominal[team]
            over = (
                "gpus"
                if ag > n.gpu
                else "cpus"
                if ac > n.cpu
                else "memory_gb"
                if am > n.mem
                else None
            )
            if over:
                return _PROBLEMS[over, "nominal_non_preemptible"]
        return None

    def own_limits_break(
        self, team: str, request: Resources, preemptible: bool, released: Resources
    ) -> bool:
        """True when `request` breaks one of the team's own limits even after the team gives
        back `released`: then `check` fails whatever other teams give back (a preemption
        plan whose own-team victims free less cannot pass)."""
        u = self.usage[team]
        return (
            self._own_limits(
                team,
                u.gpu - released.gpu + request.gpu,
                u.cpu - released.cpu + request.cpu,
                u.mem - released.mem + request.mem,
                preemptible,
            )
            is not None
        )

    def fits_after_release(
        self, team: str, request: Resources, preemptible: bool, released: Resources
    ) -> bool:
        """Would `request` fit (`check`) once the team gave back `released` of its usage?
        Without a clone: the team's usage and its draw on the pool both shrink by what it
        gives back, which is `check` of `request - released` at today's usage (every limit
        `check` tests is a sum of the two, or a difference against the usage itself)."""
        return self.check(team, request - released, preemptible) is None

    def without(self, victims: Iterable[Job]) -> QuotaLedger:
        """A clone with every victim's demand given back: each team's release summed first,
        then applied once (the pool's and the borrowers' bookkeeping depend only on each
        team's usage before and after, so this equals removing them one by one). Per-model
        usage is left as it was: jobs carry no placement; a preemption search gives back its
        victims' GPUs of each model itself (`victim_rules.trial_without`)."""
        release: dict[str, list[int]] = {}
        for v in victims:
            d = v.demand
            r = release.get(v.team)
            if r is None:
                release[v.team] = [d.gpu, d.cpu, d.mem]
            else:
                r[0] += d.gpu
                r[1] += d.cpu
                r[2] += d.mem
        new = self.clone()
        for team, (g, c, m) in release.items():
            new._change(team, -g, -c, -m)
        return new

    def add(self, team: str, amount: Resources) -> None:
        self._change(team, amount.gpu, amount.cpu, amount.mem)

    def remove(self, team: str, amount: Resources) -> None:
        self._change(team, -amount.gpu, -amount.cpu, -amount.mem)

    def _change(self, team: str, dg: int, dc: int, dm: int) -> None:
        u = self.usage[team]
        bg, bc, bm = u.gpu, u.cpu, u.mem
        ag, ac, am = bg + dg, bc + dc, bm + dm
        self.usage[team] = Resources(ag, ac, am)
        g, p = self._guaranteed[team], self.pool_used
        gg, gc, gm = g.gpu, g.cpu, g.mem
        dg = (ag - gg if ag > gg else 0) - (bg - gg if bg > gg else 0)
        dc = (ac - gc if ac > gc else 0) - (bc - gc if bc > gc else 0)
        dm = (am - gm if am > gm else 0) - (bm - gm if bm > gm else 0)
        path = self._paths.get(team) if self._paths else None
        if path:  # carried up the team's cohorts: what reaches the root's pool
            steps, d = carry_up(path, self.cohort_used, Resources(dg, dc, dm))
            for c, _, after in steps:
                self.cohort_used[c.name] = after
            dg, dc, dm = d.gpu, d.cpu, d.mem
        self.pool_used = Resources(p.gpu + dg, p.cpu + dc, p.mem + dm)
        n = self._nominal[team]
        if ag > n.gpu or ac > n.cpu or am > n.mem:
            self.borrowers.add(team)
        else:
            self.borrowers.discard(team)

    def any_borrowing(self, besides: str) -> bool:
        """True when some team other than `besides` uses more than its nominal."""
        b = self.borrowers
        return len(b) > (besides in b)

    def borrowing(self, team: str) -> bool:
        """True when the team uses more than its nominal of some resource."""
        return team in self.borrowers

    def fits_nominal_with(self, team: str, request: Resources) -> bool:
        """True when the team's usage plus `request` stays within its nominal everywhere."""
        u, n = self.usage[team], self._nominal[team]
        return (
            u.gpu + request.gpu <= n.gpu
            and u.cpu + request.cpu <= n.cpu
            and u.mem + request.mem <= n.mem
        )

    @property
    def tree(self) -> bool:
        """Do the teams sit in an organization tree (cohorts)?"""
        return bool(self._paths)

    def tree_share(self, team: str, total: Resources) -> tuple[float, ...]:
        """Fair share down the tree: the weighted dominant share of each of the team's cohorts,
        the top one first, then the team's own. Compared as tuples, a department's share
        decides before its teams' (a team at the root is compared by its own)."""
        out = []
        for c in reversed(self._paths.get(team, ())):
            used = ZERO
            for member in self._members[c.name]:
                used = used + self.usage[member]
            out.append(_share(used, total) / c.weight)
        out.append(self.dominant_share(team, total))
        return tuple(out)

    def same_top(self, team: str) -> tuple[str, ...]:
        """The teams under the team's top-level cohort (just the team, at the root): whose
        tree shares change when its usage does."""
        path = self._paths.get(team)
        return self._members[path[-1].name] if path else (team,)

    def dominant_share(self, team: str, total: Resources) -> float:
        """Weighted DRF share: the largest fraction of any cluster resource, over the weight."""
        return _share(self.usage[team], total) / self.teams[team].weight


def _share(u: Resources, total: Resources) -> float:
    """The largest fraction of any cluster resource that `u` holds."""
    share = 0.0
    if total.gpu:
        share = u.gpu / total.gpu
    if total.cpu:
        share = max(share, u.cpu / total.cpu)
    if total.mem:
        share = max(share, u.mem / total.mem)
    return share
