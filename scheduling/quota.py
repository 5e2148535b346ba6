"""Team quotas: nominal (guaranteed), borrowing and lending, in one cohort of all teams.

The model follows Kueue's cohorts. Each team's nominal quota is split into a guaranteed part
(nominal - lending_limit), which only it may use, and a lendable part, which goes into a pool
shared by the cohort. A team may use its guaranteed part plus whatever of the pool is free, up to
nominal + borrowing_limit. Usage above nominal is *borrowed*: it may be reclaimed by preemption
when its lender wants it back.

Resources a team's nominal does not mention are not limited by quota (only by the cluster).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduling.resources import UNLIMITED, ZERO, Resources


@dataclass(frozen=True, slots=True)
class Team:
    """A team's quota. Unset limits are UNLIMITED (borrowing) or all of nominal (lending)."""

    name: str
    nominal: Resources
    borrowing_limit: Resources
    lending_limit: Resources
    weight: float = 1.0

    @property
    def guaranteed(self) -> Resources:
        return (self.nominal - self.lending_limit).clamp_low()

    @property
    def ceiling(self) -> Resources:
        """The most this team may ever use: nominal + borrowing limit."""
        return _cap(self.nominal + self.borrowing_limit)


def _cap(r: Resources) -> Resources:
    return Resources(min(r.gpu, UNLIMITED), min(r.cpu, UNLIMITED), min(r.mem, UNLIMITED))


@dataclass(frozen=True, slots=True)
class QuotaProblem:
    """Why a request does not fit a team's quota right now."""

    resource: str  # gpus | cpus | memory_gb
    limit: str  # borrowing_limit | cohort | nominal_non_preemptible

    def message(self, team: str) -> str:
        if self.limit == "borrowing_limit":
            return f"team {team} would exceed nominal + borrowing_limit for {self.resource}"
        if self.limit == "nominal_non_preemptible":
            return (
                f"team {team} would exceed its nominal {self.resource}, and a non-preemptible "
                "job may not borrow"
            )
        return f"the cohort has no idle {self.resource} left to lend to team {team}"


def cohort_pool(teams: Mapping[str, Team]) -> Resources:
    """What the teams lend to each other in all: the sum of their lending limits."""
    pool = ZERO
    for t in teams.values():
        pool = pool + _cap(t.lending_limit)
    return pool


class QuotaLedger:
    """Usage per team and of the cohort's lending pool; cheap to clone for a cycle's scratch."""

    __slots__ = ("_ceiling", "_guaranteed", "pool_capacity", "pool_used", "teams", "usage")

    def __init__(self, teams: Mapping[str, Team]) -> None:
        self.teams = teams
        self.usage: dict[str, Resources] = {name: ZERO for name in teams}
        self._guaranteed = {name: t.guaranteed for name, t in teams.items()}
        self._ceiling = {name: t.ceiling for name, t in teams.items()}
        self.pool_capacity = cohort_pool(teams)
        self.pool_used = ZERO

    def clone(self) -> QuotaLedger:
        new = object.__new__(QuotaLedger)
        new.teams = self.teams
        new.usage = dict(self.usage)
        new._guaranteed = self._guaranteed
        new._ceiling = self._ceiling
        new.pool_capacity = self.pool_capacity
        new.pool_used = self.pool_used
        return new

    def _pool_delta(self, team: str, before: Resources, after: Resources) -> tuple[int, int, int]:
        """How the team's draw on the lending pool changes from `before` to `after` usage."""
        g = self._guaranteed[team]
        return (
            max(after.gpu - g.gpu, 0) - max(before.gpu - g.gpu, 0),
            max(after.cpu - g.cpu, 0) - max(before.cpu - g.cpu, 0),
            max(after.mem - g.mem, 0) - max(before.mem - g.mem, 0),
        )

    def check(self, team: str, request: Resources, preemptible: bool = True) -> QuotaProblem | None:
        """None when `request` fits the team's quota now, else the first limit it breaks."""
        before = self.usage[team]
        after = before + request
        over = after.first_excess(self._ceiling[team])
        if over:
            return QuotaProblem(over, "borrowing_limit")
        if not preemptible:
            over = after.first_excess(self.teams[team].nominal)
            if over:
                return QuotaProblem(over, "nominal_non_preemptible")
        dg, dc, dm = self._pool_delta(team, before, after)
        used, cap = self.pool_used, self.pool_capacity
        if used.gpu + dg > cap.gpu:
            return QuotaProblem("gpus", "cohort")
        if used.cpu + dc > cap.cpu:
            return QuotaProblem("cpus", "cohort")
        if used.mem + dm > cap.mem:
            return QuotaProblem("memory_gb", "cohort")
        return None

    def add(self, team: str, amount: Resources) -> None:
        before = self.usage[team]
        after = before + amount
        self.usage[team] = after
        dg, dc, dm = self._pool_delta(team, before, after)
        u = self.pool_used
        self.pool_used = Resources(u.gpu + dg, u.cpu + dc, u.mem + dm)

    def remove(self, team: str, amount: Resources) -> None:
        self.add(team, Resources(-amount.gpu, -amount.cpu, -amount.mem))

    def any_borrowing(self, besides: str) -> bool:
        """True when some team other than `besides` uses more than its nominal."""
        return any(self.borrowing(t) for t in self.teams if t != besides)

    def borrowing(self, team: str) -> bool:
        """True when the team uses more than its nominal of some resource."""
        return not self.usage[team].fits_in(self.teams[team].nominal)

    def below_nominal_after(self, team: str, release: Resources) -> bool:
        """True when releasing `release` would take the team below its nominal somewhere.

        Only resources where the team is at or above nominal count: a team already below its
        nominal in CPUs is not 'taken below' by losing more CPUs, but it may not lose borrowed
        GPUs below its GPU nominal.
        """
        t = self.teams[team]
        u = self.usage[team]
        after = u - release
        return (
            (release.gpu > 0 and after.gpu < t.nominal.gpu)
            or (release.cpu > 0 and u.cpu > t.nominal.cpu and after.cpu < t.nominal.cpu)
            or (release.mem > 0 and u.mem > t.nominal.mem and after.mem < t.nominal.mem)
        )

    def dominant_share(self, team: str, total: Resources) -> float:
        """Weighted DRF share: the largest fraction of any cluster resource, over the weight."""
        u = self.usage[team]
        share = 0.0
        if total.gpu:
            share = u.gpu / total.gpu
        if total.cpu:
            share = max(share, u.cpu / total.cpu)
        if total.mem:
            share = max(share, u.mem / total.mem)
        return share / self.teams[team].weight
