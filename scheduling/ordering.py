"""The order in which a cycle considers pending jobs: Berth's orderings, and the iterator.

- `DRF` (Berth's): jobs that fit in their team's nominal quota before jobs that would borrow,
  whatever their priority (as Kueue orders a cohort: guaranteed quota is served first, or a
  borrower's high-priority job takes freed GPUs that a lender wants back, is reclaimed minutes
  later, retakes them, and so on; and another team's priority never outranks a team's
  guarantee); then higher priority; then the team with the smallest weighted dominant-resource
  share (DRF over GPUs, CPUs, memory); priority then FIFO within a team. Shares are re-read
  after each admission, so one team cannot take a whole cycle.
- `DRF_SMALLEST_FIRST`: the same across teams; within a team, priority, then the fewest GPUs
  first, then FIFO (shortest-job-first with the request as the proxy for size: the
  starvation guard serves the big jobs it passes over). Measured against `DRF` in
  docs/decisions/0012.

The baselines' orderings (one FIFO queue, priority across queues, Kueue's BestEffortFIFO)
are strategies of the same shape in `scheduling/simulator/baselines.py`.

Each team's queue is split into classes of identical jobs (`Pending.klass`), each in FIFO order.
Jobs of one class fail or succeed alike within a cycle, so when one fails its class is closed
and the rest of it costs nothing: a cycle's work grows with the number of classes, not of jobs.
Merging the class cursors with a heap gives exactly the order of merging whole team queues.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from scheduling.jobs import Pending
from scheduling.snapshot import Snapshot
from scheduling.strategies import Ordering


class Candidates:
    """Iterator over pending jobs in policy order, with classes closable mid-cycle.

    Two levels, as Kueue's queues: each team's queue is in its own order (`Ordering.within`),
    and the teams' heads compete in a heap by the ordering's key (`Ordering.across`). So a
    team's lower-priority job never goes before its own higher-priority one just because it
    would not borrow: it waits for its turn behind its head, as in a Kueue ClusterQueue.
    It is the `strategies.OrderView` the keys read.
    """

    def __init__(
        self,
        snap: Snapshot,
        ordering: Ordering,
        share: Callable[[str], float | tuple[float, ...]],
        borrows: Callable[[Pending], bool],
        related: Callable[[str], Iterable[str]],
    ) -> None:
        self._share_of = share
        self._related = related
        self.borrows = borrows
        self._key_of = ordering.across
        self._within = within = ordering.within
        self._shares: dict[str, float | tuple[float, ...]] = {}  # per team, until it changes
        self._version: dict[str, int] = {}
        self._closed_classes: set[tuple[str, tuple]] = set()
        self._queues = snap.queues
        # Per team: a heap of its classes' next jobs, (order in the team, shape, job, rest).
        # `rest` is an iterator over the class past that job, None until it is needed: most
        # classes close at their first job.
        self._teams: dict[str, list[tuple]] = {}
        self._heap: list[tuple] = []  # per team with jobs left: (key of its head, version, team)
        for team, classes in snap.queues.items():
            if not classes:
                continue
            entries = []
            for shape, queue in classes.items():
                p = queue[0]
                entries.append((within(p), shape, p, None))
            heapq.heapify(entries)
            self._teams[team] = entries
            self._version[team] = 0
            self._heap.append((self._key_of(self, entries[0][2], team), 0, team))
        heapq.heapify(self._heap)

    def share(self, team: str) -> float | tuple[float, ...]:
        share = self._shares.get(team)
        if share is None:
            share = self._shares[team] = self._share_of(team)
        return share

    def changed(self, team: str) -> None:
        """The team's usage changed (admission or preemption): its head's key must be re-read,
        and in an organization tree those of the teams under its top cohort, whose cohorts'
        shares in their keys moved with it."""
        for member in self._related(team):
            if member in self._version:
                self._version[member] += 1
            self._shares.pop(member, None)

    def close_class(self, team: str, shape: tuple) -> None:
        self._closed_classes.add((team, shape))

    def _rest(self, team: str, shape: tuple, rest: Iterator[Pending] | None) -> Iterator[Pending]:
        """The class past its first job, where `rest` is not made yet."""
        if rest is None:
            rest = iter(self._queues[team][shape])
            next(rest)
        return rest

    def take_class(self, team: str, shape: tuple) -> list[Pending]:
        """Close the class of the job just yielded and return the rest of it, in order: the
        jobs that closing it skips (`shortcuts.EXACT` examines them there and then)."""
        entries = self._teams[team]
        rest: list[Pending] = []
        if entries and entries[0][1] == shape:
            order, _, p, it = entries[0]
            it = self._rest(team, shape, it)
            rest = list(it)
            entries[0] = (order, shape, p, it)  # spent: a class-mate taking it gets none
        self.close_class(team, shape)
        return rest

    def __iter__(self) -> Iterator[Pending]:
        heap, version, teams = self._heap, self._version, self._teams
        closed, key_of, within = self._closed_classes, self._key_of, self._within
        heappop, heappush = heapq.heappop, heapq.heappush
        while heap:
            _, ver, team = heappop(heap)
            entries = teams[team]
            while entries and (team, entries[0][1]) in closed:  # past classes closed since
                heappop(entries)
            if not entries:
                continue
            p = entries[0][2]
            if ver != version[team]:  # its usage changed: re-key and let the heap decide
                heappush(heap, (key_of(self, p, team), version[team], team))
                continue
            yield p
            _, shape, _, rest = heappop(entries)  # p's class: it was the head
            if (team, shape) not in closed:
                rest = self._rest(team, shape, rest)
                nxt = next(rest, None)
                if nxt is not None:
                    heappush(entries, (within(nxt), shape, nxt, rest))
            while entries and (team, entries[0][1]) in closed:
                heappop(entries)
            if entries:
                heappush(heap, (key_of(self, entries[0][2], team), version[team], team))


def priority_then_fifo(p: Pending) -> tuple:
    """A team's queue as Kueue's ClusterQueue keeps it: priority, then FIFO."""
    return p.order


def _smallest_first(p: Pending) -> tuple:
    return (p.order[0], p.job.demand.gpu, p.enqueued, p.seq)


def _drf(c: Candidates, p: Pending, team: str) -> tuple:
    return (c.borrows(p), p.order[0], c.share(team), p.enqueued, p.seq)


DRF = Ordering("drf", priority_then_fifo, _drf)
DRF_SMALLEST_FIRST = Ordering("drf-smallest-first", _smallest_first, _drf)
# Berth's orderings: what the store may run and a policy file may name.
ORDERINGS: dict[str, Ordering] = {o.name: o for o in (DRF, DRF_SMALLEST_FIRST)}
