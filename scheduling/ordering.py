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
        self._version: dict[str, int] = {}
        self._closed_classes: set[tuple[str, tuple]] = set()
        # Per team: a heap of its classes' next jobs, (order in the team, shape, job, rest).
        self._teams: dict[str, list[tuple]] = {}
        self._heap: list[tuple] = []  # per team with jobs left: (key of its head, version, team)
        fifo = ordering == "fifo"
        for team, classes in snap.queues.items():
            if not classes:
                continue
            entries = []
            for shape, queue in classes.items():
                it = iter(queue)
                p = next(it)
                entries.append(((p.enqueued, p.seq) if fifo else p.order, shape, p, it))
            heapq.heapify(entries)
            self._teams[team] = entries
            self._version[team] = 0
            self._heap.append((self._key(entries[0][2], team), 0, team))
        heapq.heapify(self._heap)

    def _key(self, p: Pending, team: str) -> tuple:
        if self._ordering == "drf":
            return (self._borrows(p), p.order[0], self._share(team), p.enqueued, p.seq)
        if self._ordering == "kueue":
            return (self._borrows(p), p.order[0], p.enqueued, p.seq)
        if self._ordering == "priority_fifo":
            return p.order
        return (p.enqueued, p.seq)

    def changed(self, team: str) -> None:
        """The team's usage changed (admission or preemption): its head's key must be re-read."""
        if team in self._version:
            self._version[team] += 1

    def close_class(self, team: str, shape: tuple) -> None:
        self._closed_classes.add((team, shape))

    def take_class(self, team: str, shape: tuple) -> list[Pending]:
        """Close the class of the job just yielded and return the rest of it, in order: the
        jobs that closing it skips (`shortcuts.EXACT` examines them there and then)."""
        entries = self._teams[team]
        rest = list(entries[0][3]) if entries and entries[0][1] == shape else []
        self.close_class(team, shape)
        return rest

    def _head(self, team: str) -> Pending | None:
        """The team's next job, past classes closed since they were queued."""
        entries = self._teams[team]
        closed = self._closed_classes
        while entries and (team, entries[0][1]) in closed:
            heapq.heappop(entries)
        return entries[0][2] if entries else None

    def __iter__(self) -> Iterator[Pending]:
        heap, version, teams = self._heap, self._version, self._teams
        fifo = self._ordering == "fifo"
        while heap:
            _, ver, team = heapq.heappop(heap)
            p = self._head(team)
            if p is None:
                continue
            if ver != version[team]:  # its usage changed: re-key and let the heap decide
                heapq.heappush(heap, (self._key(p, team), version[team], team))
                continue
            yield p
            entries = teams[team]
            _, shape, _, it = heapq.heappop(entries)  # p's class: it was the head
            if (team, shape) not in self._closed_classes:
                nxt = next(it, None)
                if nxt is not None:
                    order = (nxt.enqueued, nxt.seq) if fifo else nxt.order
                    heapq.heappush(entries, (order, shape, nxt, it))
            p = self._head(team)
            if p is not None:
                heapq.heappush(heap, (self._key(p, team), version[team], team))
