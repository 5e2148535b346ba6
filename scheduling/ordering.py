"""The order in which a cycle considers pending jobs.

- `drf`: jobs that fit in their team's nominal quota before jobs that would borrow, whatever
  their priority (as Kueue orders a cohort: guaranteed quota is served first, or a borrower's
  high-priority job takes freed GPUs that a lender wants back, is reclaimed minutes later,
  retakes them, and so on; and another team's priority never outranks a team's guarantee);
  then higher priority; then the team with the smallest weighted dominant-resource share (DRF
  over GPUs, CPUs, memory); FIFO within a team. Shares are re-read after each admission, so
  one team cannot take a whole cycle.
- `kueue`: Kueue's BestEffortFIFO in a cohort without fair sharing: heads that do not borrow
  first, then priority, then age.
- `priority_fifo`: priority, then age, across all queues.
- `fifo`: one global queue in submission order.

Each team's queue is split into classes of identical jobs (`Pending.klass`), each in FIFO order.
Jobs of one class fail or succeed alike within a cycle, so when one fails its class is closed
and the rest of it costs nothing: a cycle's work grows with the number of classes, not of jobs.
Merging the class cursors with a heap gives exactly the order of merging whole team queues.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from scheduling.jobs import Pending
from scheduling.snapshot import Snapshot


class Candidates:
    """Iterator over pending jobs in policy order, with classes closable mid-cycle.

    Two levels, as Kueue's queues: each team's queue is in its own order (priority, then FIFO;
    submission order under `fifo`), and the teams' heads compete in a heap by the policy's key.
    So a team's lower-priority job never goes before its own higher-priority one just because
    it would not borrow: it waits for its turn behind its head, as in a Kueue ClusterQueue.
    """

    def __init__(
        self,
        snap: Snapshot,
        ordering: str,
        share: Callable[[str], float],
        borrows: Callable[[Pending], bool],
    ) -> None:
        self._ordering = ordering
        self._share = share
        self._borrows = borrows
        # Plain functions, not bound methods: a bound method kept on self would make a
        # reference cycle, and the garbage collector's passes over a cycle's leftovers cost
        # more than the dispatch saved.
        self._key_of = _KEYS.get(ordering, _fifo_key)
        self._shares: dict[str, float] = {}  # per team, until its usage changes
        self._version: dict[str, int] = {}
        self._closed_classes: set[tuple[str, tuple]] = set()
        self._queues = snap.queues
        # Per team: a heap of its classes' next jobs, (order in the team, shape, job, rest).
        # `rest` is an iterator over the class past that job, None until it is needed: most
        # classes close at their first job.
        self._teams: dict[str, list[tuple]] = {}
        self._heap: list[tuple] = []  # per team with jobs left: (key of its head, version, team)
        fifo = ordering == "fifo"
        for team, classes in snap.queues.items():
            if not classes:
                continue
            entries = []
            for shape, queue in classes.items():
                p = queue[0]
                entries.append(((p.enqueued, p.seq) if fifo else p.order, shape, p, None))
            heapq.heapify(entries)
            self._teams[team] = entries
            self._version[team] = 0
            self._heap.append((self._key(entries[0][2], team), 0, team))
        heapq.heapify(self._heap)

    def _key(self, p: Pending, team: str) -> tuple:
        return self._key_of(self, p, team)

    def changed(self, team: str) -> None:
        """The team's usage changed (admission or preemption): its head's key must be re-read."""
        if team in self._version:
            self._version[team] += 1
            self._shares.pop(team, None)

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
        closed, key_of = self._closed_classes, self._key_of
        fifo = self._ordering == "fifo"
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
                    order = (nxt.enqueued, nxt.seq) if fifo else nxt.order
                    heappush(entries, (order, shape, nxt, rest))
            while entries and (team, entries[0][1]) in closed:
                heappop(entries)
            if entries:
                heappush(heap, (key_of(self, entries[0][2], team), version[team], team))


def _drf_key(c: Candidates, p: Pending, team: str) -> tuple:
    share = c._shares.get(team)
    if share is None:
        share = c._shares[team] = c._share(team)
    return (c._borrows(p), p.order[0], share, p.enqueued, p.seq)


def _kueue_key(c: Candidates, p: Pending, team: str) -> tuple:
    return (c._borrows(p), p.order[0], p.enqueued, p.seq)


def _priority_fifo_key(c: Candidates, p: Pending, team: str) -> tuple:
    return p.order


def _fifo_key(c: Candidates, p: Pending, team: str) -> tuple:
    return (p.enqueued, p.seq)


_KEYS = {"drf": _drf_key, "kueue": _kueue_key, "priority_fifo": _priority_fifo_key}
