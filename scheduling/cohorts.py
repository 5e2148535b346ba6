"""The organization tree: cohorts of teams, as Kueue's hierarchical cohorts (decision 0023).

A cohort's quota is its own nominal plus what its children (teams and cohorts) lend it; it
keeps a guaranteed part for its subtree (quota - lending_limit) and lends the rest to its
parent's pool; what a node uses beyond its guaranteed part it draws on its parent's pool,
and a cohort's children's draw stays within its quota + borrowing limit. The root (the cohort
of all teams) has no limits of its own: its pool is what its children lend. The ledger keeps
these sums as usage changes (`quota.QuotaLedger`); the functions here work them out whole,
for rejection at submission, the audit and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from scheduling.resources import UNLIMITED, ZERO, Resources

if TYPE_CHECKING:
    from scheduling.quota import Team


@dataclass(frozen=True, slots=True)
class Cohort:
    """A node of the organization tree (a department, a group of teams), with what its
    subtree's teams and cohorts lend it (`quota`, worked out when the teams file is read,
    `config.build_teams`). Limits unset are UNLIMITED (borrowing) or all of its quota
    (lending); `nominal` is its own quota, beside what its children lend it."""

    name: str
    parent: str | None
    nominal: Resources
    borrowing_limit: Resources
    lending_limit: Resources | None
    quota: Resources  # own nominal + what its children lend it
    weight: float = 1.0  # its fair-share weight against its siblings
    guaranteed: Resources = field(init=False, repr=False, compare=False)
    ceiling: Resources = field(init=False, repr=False, compare=False)  # quota + borrowing
    lends: Resources = field(init=False, repr=False, compare=False)  # to its parent's pool

    def __post_init__(self) -> None:
        lending = self.quota if self.lending_limit is None else self.lending_limit
        guaranteed = (self.quota - lending).clamp_low()
        object.__setattr__(self, "guaranteed", guaranteed)
        object.__setattr__(self, "ceiling", capped(self.quota + self.borrowing_limit))
        object.__setattr__(self, "lends", capped(self.quota - guaranteed))


def capped(r: Resources) -> Resources:
    """Each resource at most UNLIMITED (sums of unlimited quotas stay unlimited)."""
    return Resources(min(r.gpu, UNLIMITED), min(r.cpu, UNLIMITED), min(r.mem, UNLIMITED))


def cohort_pool(teams: Mapping[str, Team]) -> Resources:
    """The root's pool: what the teams outside any cohort and the top-level cohorts lend to
    each other in all (without cohorts: the sum of the teams' lending limits)."""
    pool = ZERO
    tops: dict[str, Cohort] = {}
    for t in teams.values():
        if t.cohorts:
            tops[t.cohorts[-1].name] = t.cohorts[-1]
        else:
            pool = pool + t.lends
    for c in tops.values():
        pool = pool + c.lends
    return capped(pool)


def reachable(team: Team, teams: Mapping[str, Team]) -> Resources:
    """The most the team could ever use, every other team using nothing: its guaranteed part
    plus what the pools up its cohorts could lend it, within every level's limits."""
    room = cohort_pool(teams)  # what the root's pool holds
    for c in reversed(team.cohorts):  # from the top down: what each level may hold
        room = _least(c.ceiling, c.guaranteed + room)
    return _least(team.ceiling, team.guaranteed + room)


def cohort_usage(
    teams: Mapping[str, Team], usage: Mapping[str, Resources]
) -> tuple[dict[str, Resources], Resources]:
    """What each cohort's children draw on it (Kueue's usage of a cohort), and what the root's
    pool lends in all, for `usage` (team -> usage). For the audit and tests: the ledger keeps
    the same sums as usage changes (`QuotaLedger.cohort_used`)."""
    stored: dict[str, Resources] = {}  # cohort -> what its children draw on its pool
    root = ZERO
    for name, t in teams.items():
        draw = (usage.get(name, ZERO) - t.guaranteed).clamp_low()
        if t.cohorts:
            c = t.cohorts[0].name
            stored[c] = stored.get(c, ZERO) + draw
        else:
            root = root + draw
    # Cohorts deepest first, so each adds its draw to its parent's before the parent's turn.
    for c in _deepest_first(teams):
        draw = (stored.get(c.name, ZERO) - c.guaranteed).clamp_low()
        if c.parent is None:
            root = root + draw
        else:
            stored[c.parent] = stored.get(c.parent, ZERO) + draw
    return stored, root


def tree_excess(
    teams: Mapping[str, Team], usage: Mapping[str, Resources]
) -> tuple[str, str] | None:
    """The first cohort, deepest first (or "" for the root), whose limits `usage` (team ->
    usage) breaks, with the resource; None when every level holds. The teams' own ceilings are
    not tested. For the audit and tests, as `cohort_usage`."""
    stored, root = cohort_usage(teams, usage)
    for c in _deepest_first(teams):
        over = stored.get(c.name, ZERO).first_excess(c.ceiling)
        if over:
            return c.name, over
    over = root.first_excess(cohort_pool(teams))
    return ("", over) if over else None


@lru_cache(maxsize=4096)
def below_common(team: Team, other: Team) -> tuple[Cohort, ...]:
    """The team's cohorts below the closest one it shares with `other` (closest first; all of
    them when they share none): the levels whose borrowing a reclaim by `other` may take back
    (Kueue's hierarchical reclaim walks a candidate's path up to the lowest common ancestor)."""
    shared = {c.name for c in other.cohorts}
    out = []
    for c in team.cohorts:
        if c.name in shared:
            break
        out.append(c)
    return tuple(out)


def reclaim_path_holds(
    path: tuple[Cohort, ...],
    used: Mapping[str, int],
    draw_before: int,
    draw_after: int,
    keep_nominal: bool,
) -> list[tuple[str, int]] | None:
    """Does a reclaim victim's subtree let it go? `path`: its team's cohorts below the one it
    shares with the preemptor's (`below_common`); `used`: each cohort's usage in GPUs (what
    its children draw on it); the team's draw on its first cohort before and after the
    victim goes. Each cohort on the path must be borrowing from its parent (using more than
    its quota), else the victim's GPUs are its own department's, not the preemptor's to take
    back; with `keep_nominal` (Berth's rule) it must also keep its quota once the victim is
    gone (Kueue's rule: borrowing when taken is enough). Returns what each cohort's usage
    drops by (to count against later victims of the same plan), or None when it may not go.
    GPUs only: the resource a GPU cluster's reclaims are for."""
    drops = []
    delta = draw_after - draw_before  # <= 0
    for c in path:
        before = used.get(c.name, 0)
        after = before + delta
        quota = c.quota.gpu
        if before <= quota or (keep_nominal and after < quota):
            return None
        drops.append((c.name, -delta))
        delta = parent_draw(after, c.guaranteed.gpu) - parent_draw(before, c.guaranteed.gpu)
    return drops


def _cohorts(teams: Mapping[str, Team]) -> dict[str, Cohort]:
    return {c.name: c for t in teams.values() for c in t.cohorts}


def _deepest_first(teams: Mapping[str, Team]) -> list[Cohort]:
    return sorted(_cohorts(teams).values(), key=lambda c: -_depth(c, teams))


def _depth(c: Cohort, teams: Mapping[str, Team]) -> int:
    by_name, depth = _cohorts(teams), 0
    while c.parent is not None:
        c, depth = by_name[c.parent], depth + 1
    return depth


def _least(a: Resources, b: Resources) -> Resources:
    return Resources(min(a.gpu, b.gpu), min(a.cpu, b.cpu), min(a.mem, b.mem))


def carry_up(
    path: tuple[Cohort, ...], used: Mapping[str, Resources], delta: Resources
) -> tuple[list[tuple[Cohort, Resources, Resources]], Resources]:
    """A team's change of draw carried up its cohorts (`path`, the closest first; `used`:
    what each cohort's children draw on it): each cohort it reaches with its usage before and
    after, and the change that reaches the root's pool. Each level passes up only what moves
    beyond its guaranteed part; one that keeps the whole change ends the walk."""
    steps = []
    for c in path:
        if delta == ZERO:
            break
        before = used.get(c.name, ZERO)
        after = before + delta
        steps.append((c, before, after))
        delta = (after - c.guaranteed).clamp_low() - (before - c.guaranteed).clamp_low()
    return steps, delta


def grown_past(before: Resources, after: Resources, limit: Resources) -> str | None:
    """The first resource that grew from `before` to `after` and is over `limit` after."""
    grew = Resources(
        after.gpu if after.gpu > before.gpu else 0,
        after.cpu if after.cpu > before.cpu else 0,
        after.mem if after.mem > before.mem else 0,
    )
    return grew.first_excess(limit)


def parent_draw(used: int, guaranteed: int) -> int:
    """What a usage draws on its parent's pool: the part beyond the guaranteed one."""
    return used - guaranteed if used > guaranteed else 0
