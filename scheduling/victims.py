"""The running jobs a cycle may preempt, indexed once per cycle (`VictimPool`).

Split from preemption.py, which searches among them for a plan: this module says who may be a
victim at all (preemptible, past the minimum run time, within the guards) and when the next
one becomes eligible, so that a failed search knows when to look again.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter

from sortedcontainers import SortedKeyList

from scheduling.capacity import Capacity
from scheduling.jobs import Running
from scheduling.quota import QuotaLedger
from scheduling.resources import Resources
from scheduling.snapshot import Snapshot
from scheduling.victim_rules import lends_back

BY_LOSS = attrgetter("loss")  # Running.loss: cheapest losses first


def loss_at(now: float) -> Callable[[Running], tuple]:
    """The victim order of a checkpoint-aware policy at `now`: lower priority, then the fewest
    seconds a preemption destroys (`Running.unsaved_s`), then as `BY_LOSS`. For jobs that
    never checkpoint it is `BY_LOSS`'s order (unsaved = now - start)."""

    def key(r: Running) -> tuple:
        return (r.job.rank, r.unsaved_s(now), -r.start_time, r.job.id)

    return key


def _checkpoints(runs: Iterable[Running]) -> bool:
    return any(r.job.checkpoint_s != math.inf for r in runs)


def sum_demand(runs: Iterable[Running]) -> Resources:
    """What `runs` demand in all (one walk in Python, the sums in C)."""
    demands = [r.job.demand for r in runs]
    return Resources(sum(map(_G, demands)), sum(map(_C, demands)), sum(map(_M, demands)))


def _by_node(runs: Iterable[Running]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in runs:
        for n, k in r.gpus_by_node:
            out[n] = out.get(n, 0) + k
    return out


def _started(r: Running) -> tuple[float, str]:  # the state's running_by_start order
    return (r.start_time, r.job.id)


_SLACK_S = 1e-3  # widens a bisected window of start times; the exact tests then decide
_GPU = attrgetter("gpu")  # Running.gpu: its job's GPUs (milli)
_G, _C, _M = attrgetter("gpu"), attrgetter("cpu"), attrgetter("mem")  # of a Resources
_NEVER = 1 << 62  # max_preemptions at or above this filters no one


def _young_enough(r: Running, now: float, min_rt: float) -> bool:
    return r.start_time + min_rt <= now  # the same sum as the wake-up


def _not_too_old(r: Running, now: float, max_rt: float) -> bool:
    start = r.start_time
    return now - start <= max_rt and start >= now - max_rt


class VictimPool:
    """Running jobs that may be preempted now, by team, cheapest losses first. Made once per
    cycle, on the first preemption attempt; a team's lists are made when a search first needs
    them (a cycle searches for a few teams' jobs, and a list costs a walk over the team's
    recent jobs), and kept in plain dicts: no bound method or closure on the pool, whose
    reference cycle would keep each cycle's lists alive until the collector runs.

    - `victims(team)` (priority victims): preemptible, past their minimum run time, preempted
      fewer than `max_preemptions` times, running no longer than `max_runtime_s`: a team's own
      higher-priority job may not destroy long work or preempt the same job again and again.
    - `reclaimable(team, guarded)`: what a lender may take back from a borrowing team: those
      (guarded) until the lender's job has waited `reclaim_deadline_s`; then (unguarded) every
      preemptible job past its minimum run time."""

    def __init__(
        self,
        snap: Snapshot,
        min_runtime_s: float,
        max_preemptions: int,
        max_runtime_s: float = float("inf"),
        checkpoint_aware: bool = False,
        saved_guards: bool = False,
    ) -> None:
        self.min_runtime_s = min_runtime_s
        # Least attained service (Policy.las): a job that checkpoints is guarded by the work a
        # preemption destroys (its unsaved seconds against max_runtime_s), not by how long it
        # has run. Its preemptions still count against max_preemptions: without that bound a
        # hunt found jobs preempting one another for ever (decision 0014, "The bound kept").
        self.saved_guards = saved_guards
        # Cheapest losses first: by start, or (checkpoint-aware) by the work lost now, where
        # a team's list is sorted again when it holds a job that checkpoints.
        self.checkpoint_aware = checkpoint_aware
        self.loss_key: Callable[[Running], tuple] = (
            loss_at(snap.now) if checkpoint_aware else BY_LOSS
        )
        self.max_preemptions = max_preemptions
        self.max_runtime_s = max_runtime_s
        self._snap = snap
        self._victims: dict[str, list[Running]] = {}
        self._gpus: dict[str, int] = {}
        # Per team, (priority, GPUs of its victims of lower priority, where they end in its
        # list): a cheap upper bound on what a priority preemption can free, and its victims.
        self._below: dict[str, list[tuple[int, int, int]]] = {}
        self._demand: dict[tuple[str, int], Resources] = {}  # (team, end in its list) -> sum
        self._shapes: dict[str, tuple[int, int, set[tuple[int, int, int]]] | None] = {}
        # Node -> whole GPUs of a team's victims; "own": only those below its top priority.
        self._held: dict[tuple[str, bool], dict[int, int]] = {}
        self._unguarded: Mapping[str, Sequence[Running]] | None = None
        self._unguarded_gpus: Mapping[str, int] = {}
        self._upcoming: list[Running] | None = None
        self._upcoming_by_team: dict[str, list[Running]] | None = None

    @property
    def now(self) -> float:
        return self._snap.now

    @property
    def snapshot(self) -> Snapshot:
        return self._snap

    def victims(self, team: str) -> list[Running]:
        """The team's victims within the guards, cheapest losses first.

        The team's preemptible jobs are kept by (priority, -start, id): within one priority,
        the jobs started in the guards' window of time are a run of that order, found by
        bisection and then filtered with the exact tests (the bounds are widened by a
        millisecond so that rounding in `now - x` never leaves one out)."""
        out = self._victims.get(team)
        if out is not None:
            return out
        out = self._victims[team] = []
        # Per priority present: (priority, GPUs of the victims before it, index of its first),
        # made in the same walk: what `gpus`, `gpus_below` and `below` read.
        below = self._below[team] = []
        self._gpus[team] = 0
        snap = self._snap
        runs = snap.preemptible_by_team.get(team)
        if not runs:
            return out
        now, min_rt, max_rt = snap.now, self.min_runtime_s, self.max_runtime_s
        newest = -(now - min_rt) - _SLACK_S  # -start of the latest start that may qualify
        oldest = -(now - max_rt) + _SLACK_S
        max_p = self.max_preemptions
        total = 0
        for prio in sorted(p for p, n in snap.running_priorities[team].items() if n):
            lo = runs.bisect_key_left((prio, newest))
            if self.saved_guards:
                chunk = self._saved_guarded(runs, lo, prio)
                if chunk:
                    below.append((prio, total, len(out)))
                    total += sum(map(_GPU, chunk))
                    out.extend(chunk)
                continue
            hi = runs.bisect_key_right((prio, oldest))
            if lo >= hi:
                continue
            # Within a priority the run is by start, newest first, and each time test is
            # monotone in the start: the widened ends are trimmed with the exact tests, and
            # the run between them (a C-level slice) is filtered on preemptions alone.
            while lo < hi and not _young_enough(runs[lo], now, min_rt):
                lo += 1
            while hi > lo and not _not_too_old(runs[hi - 1], now, max_rt):
                hi -= 1
            if lo >= hi:
                continue
            chunk = runs[lo:hi]
            if max_p < _NEVER:
                chunk = [r for r in chunk if r.preemptions < max_p]
            if chunk:
                if self.checkpoint_aware and _checkpoints(chunk):
                    chunk.sort(key=self.loss_key)
                below.append((prio, total, len(out)))
                total += sum(map(_GPU, chunk))
                out.extend(chunk)
        self._gpus[team] = total
        return out

    def _saved_guarded(self, runs: SortedKeyList, lo: int, rank: int) -> list[Running]:
        """`victims`'s run of one rank under saved guards: past the minimum run time,
        preempted fewer than max_preemptions times, and within the guard of long work by run
        time, or (a job that checkpoints) by the work since its last checkpoint. A walk over
        every older job of the rank: only policies with least attained service pay it."""
        snap = self._snap
        now, min_rt, max_rt, max_p = (
            snap.now,
            self.min_runtime_s,
            self.max_runtime_s,
            self.max_preemptions,
        )
        hi = runs.bisect_key_right((rank, math.inf))
        chunk = [
            r
            for r in runs[lo:hi]
            if _young_enough(r, now, min_rt)
            and r.preemptions < max_p
            and (
                _not_too_old(r, now, max_rt)
                or (r.job.checkpoint_s != math.inf and r.unsaved_s(now) <= max_rt)
            )
        ]
        if self.checkpoint_aware and _checkpoints(chunk):
            chunk.sort(key=self.loss_key)
        return chunk

    def below(self, team: str, priority: int) -> list[Running]:
        """The team's victims with a priority lower than `priority`, in a new list: a prefix
        of `victims(team)`, which is in loss order (priority first)."""
        runs = self.victims(team)
        for prio, _, first in self._below[team]:
            if prio >= priority:
                return runs[:first]
        return runs[:]

    def gpus(self, team: str) -> int:
        """GPUs (milli) of the team's victims."""
        self.victims(team)
        return self._gpus[team]

    def gpus_below(self, team: str, priority: int) -> int:
        """GPUs of the team's victims with a priority lower than `priority`."""
        self.victims(team)
        for prio, total, _ in self._below[team]:
            if prio >= priority:
                return total
        return self._gpus[team]

    def demand_below(self, team: str, priority: int) -> Resources:
        """What the team's victims with a priority lower than `priority` demand in all: the
        most a priority preemption could give back to its team's quota. Summed when first
        asked (most teams' lists are never asked), once per cycle and prefix."""
        runs = self.victims(team)
        end = len(runs)
        for prio, _, first in self._below[team]:
            if prio >= priority:
                end = first
                break
        key = (team, end)
        demand = self._demand.get(key)
        if demand is None:
            demand = self._demand[key] = sum_demand(runs[:end])
        return demand

    def reclaimable(self, team: str, guarded: bool) -> Sequence[Running]:
        """What a lender may take back from `team`, cheapest losses first."""
        if guarded:
            return self.victims(team)
        return self._unguard().get(team, ())

    def reclaimable_gpus(self, team: str, guarded: bool) -> int:
        if guarded:
            return self.gpus(team)
        self._unguard()
        return self._unguarded_gpus.get(team, 0)

    def _unguard(self) -> Mapping[str, Sequence[Running]]:
        """Every preemptible job past its minimum run time, by team (reclaim past the
        deadline); listed once, when first needed (never under an infinite deadline)."""
        if self._unguarded is not None:
            return self._unguarded
        snap = self._snap
        if self.min_runtime_s <= 0:  # every preemptible job: the state keeps them by team
            self._unguarded_gpus = snap.preemptible_gpus
            self._unguarded = snap.preemptible_by_team  # read only
            if self.checkpoint_aware:
                self._unguarded = {
                    t: sorted(rs, key=self.loss_key) if _checkpoints(rs) else rs
                    for t, rs in snap.preemptible_by_team.items()
                }
            return self._unguarded
        everyone: dict[str, list[Running]] = {}
        now = snap.now
        # Widened as in `victims`: `now - min_runtime_s` may round below a start whose
        # `start + min_runtime_s` (the wake-up's sum) is `now` (seed 523156888: a borrower's
        # job left out of reclaim at the very instant it became a victim, 125.2 + 60).
        latest = now - self.min_runtime_s + _SLACK_S
        for r in snap.running_by_start.irange_key(max_key=(latest, "\U0010ffff")):
            if r.job.preemptible and r.start_time + self.min_runtime_s <= now:
                everyone.setdefault(r.job.team, []).append(r)
        for runs in everyone.values():
            runs.sort(key=self.loss_key)
        self._unguarded_gpus = {t: sum(r.job.demand.gpu for r in rs) for t, rs in everyone.items()}
        self._unguarded = everyone
        return everyone

    def _shapes_of(self, team: str) -> tuple[int, int, set[tuple[int, int, int]]] | None:
        """Of the team's pending classes: the top priority, the fewest whole GPUs a replica
        asks for (0: some job shares a GPU), and the distinct total demands; None if none."""
        if team in self._shapes:
            return self._shapes[team]
        classes = list(self._snap.queues.get(team, ()))  # a class starts with the job's shape
        shapes = [k[:7] for k in classes]
        known = self._shapes[team] = (
            (
                max(shape[0] for shape in shapes),
                min(0 if k[10] else k[2] for k in classes) // 1000,  # a MIG instance: 0
                {(r * g, r * c, r * m) for _, r, g, c, m, _, _ in shapes},
            )
            if shapes
            else None
        )
        return known

    def _held_by_node(self, team: str, own_top: int | None) -> dict[int, int]:
        """Node -> whole GPUs of the team's victims (only those below `own_top`, if given)."""
        key = (team, own_top is not None)
        held = self._held.get(key)
        if held is None:
            runs = self.victims(team)
            if own_top is not None:
                runs = [r for r in runs if r.job.rank < own_top]
            held = self._held[key] = _by_node(runs)
        return held

    @property
    def upcoming(self) -> list[Running]:
        """Preemptible jobs that pass their minimum run time later, in start order: when a
        search fails, the cycle wakes up as the first of these it could use becomes eligible."""
        if self._upcoming is None:
            snap, now = self._snap, self._snap.now
            since = max(now - self.max_runtime_s, now - self.min_runtime_s - _SLACK_S)
            self._upcoming = [
                r
                for r in snap.running_by_start.irange_key(min_key=(since,))
                if r.job.preemptible
                and r.start_time + self.min_runtime_s > now
                and r.start_time >= now - self.max_runtime_s
            ]
        return self._upcoming

    def _upcoming_of(self, team: str) -> list[Running]:
        if self._upcoming_by_team is None:
            by_team: dict[str, list[Running]] = {}
            for r in self.upcoming:
                by_team.setdefault(r.job.team, []).append(r)
            self._upcoming_by_team = by_team
        return self._upcoming_by_team.get(team, [])

    def next_eligible(
        self, cap: Capacity, quota: QuotaLedger, team: str, strict_tree: bool = False
    ) -> Running | None:
        """After a failed search for one of `team`'s jobs: the first running job that
        could help *any* of its pending jobs passes its minimum run time (a cycle searches
        once per team, so the wake-up must serve them all). None if none could, as things
        stand: a finish or an admission changes things, and runs a cycle anyway.

        It could help if it is the team's own and of lower priority than one of its pending
        jobs, or if it belongs to a borrowing team while one of its pending jobs would fit
        within the team's nominal (reclaim). When no node has room for the team's smallest
        whole-GPU replica, it must also bring its node to that many GPUs with the victims
        already allowed, or it frees no slot for anyone."""
        known = self._shapes_of(team)
        if known is None:
            return None
        top, smallest, demands = known
        u, nominal = quota.usage[team], quota.teams[team].nominal
        room = (nominal.gpu - u.gpu, nominal.cpu - u.cpu, nominal.mem - u.mem)
        reclaims = any(g <= room[0] and c <= room[1] and m <= room[2] for g, c, m in demands)
        lenders = (
            [
                t
                for t in quota.borrowers
                if t != team and (not strict_tree or lends_back(quota, t, team))
            ]
            if reclaims
            else []
        )
        if not self._upcoming_of(team) and not any(self._upcoming_of(t) for t in lenders):
            return None  # no job comes of age (none can, with no minimum run time)
        # Where no node has room for the smallest replica, a job coming of age must bring its
        # node there with the victims already allowed: per node, free GPUs plus the allowed
        # victims' (the team's own of lower priority, the lenders'), worked out for the nodes
        # it asks about, from per-team indexes made once a cycle.
        held = None
        if smallest and not any(cap.node_buckets[smallest:]):
            held = [self._held_by_node(team, top), *(self._held_by_node(t, None) for t in lenders)]
        # The candidates in start order: the team's own lower-priority jobs not preempted too
        # often, and every job of a lender (each list is in start order already).
        max_preemptions = self.max_preemptions
        own_next = (
            r
            for r in self._upcoming_of(team)
            if r.job.rank < top and r.preemptions < max_preemptions
        )
        sources = [own_next, *(iter(self._upcoming_of(t)) for t in lenders)]
        if held is None:  # the first one is the answer
            firsts = [r for r in (next(src, None) for src in sources) if r is not None]
            return min(firsts, key=_started, default=None)
        per_node: dict[int, int] = {}
        for r in heapq.merge(*sources, key=_started):
            if not r.shares_gpu:
                useful = False
                for n, k in r.gpus_by_node:
                    now_free = per_node.get(n)
                    if now_free is None:
                        now_free = cap.free_gpus(n) + sum(index.get(n, 0) for index in held)
                    per_node[n] = now_free = now_free + k
                    useful = useful or (now_free >= smallest and cap.usable(n))
                if not useful:
                    continue
            return r  # eligible at r.start_time + min_runtime_s
        return None
