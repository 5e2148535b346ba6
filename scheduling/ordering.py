"""The order in which a cycle considers pending jobs.

- `drf`: higher priority first; then jobs that fit in their team's nominal quota before jobs
  that would borrow (as Kueue does: guaranteed quota is served first, or a borrower would take
  freed GPUs that a lender wants back, be reclaimed, retake them, and so on); then the team
  with the smallest weighted dominant-resource share (DRF over GPUs, CPUs, memory); FIFO within
  a team. Shares are re-read after each admission, so one team cannot take a whole cycle.
- `priority_fifo`: Kueue's default across queues: priority, then age.
- `fifo`: one global queue in submission order.

Each team's queue is split into classes of identical jobs (`Job.shape`), each in FIFO order.
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
    """Iterator over pending jobs in policy order, with classes closable mid-cycle."""

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
        self._heap: list[tuple] = []
        shares = {}
        for team, classes in snap.queues.items():
            if not classes:
                continue
            self._version[team] = 0
            shares[team] = share(team) if ordering == "drf" else 0.0
            for shape, queue in classes.items():
                it = iter(queue)
                p = next(it)
                self._heap.append((self._key(p, shares[team]), 0, team, shape, p, it))
        heapq.heapify(self._heap)

    def _key(self, p: Pending, share: float) -> tuple:
        if self._ordering == "drf":
            return (p.order[0], self._borrows(p), share, p.enqueued, p.seq)
        if self._ordering == "priority_fifo":
            return p.order
        return (p.enqueued, p.seq)

    def changed(self, team: str) -> None:
        """The team's usage changed (admission or preemption): its share must be re-read."""
        if team in self._version:
            self._version[team] += 1

    def close_class(self, team: str, shape: tuple) -> None:
        self._closed_classes.add((team, shape))

    def __iter__(self) -> Iterator[Pending]:
        heap, version = self._heap, self._version
        drf = self._ordering == "drf"
        while heap:
            _, ver, team, shape, p, it = heapq.heappop(heap)
            if (team, shape) in self._closed_classes:
                continue
            if drf and ver != version[team]:  # stale share: re-key and let the heap decide
                key = self._key(p, self._share(team))
                heapq.heappush(heap, (key, version[team], team, shape, p, it))
                continue
            yield p
            if (team, shape) in self._closed_classes:
                continue
            nxt = next(it, None)
            if nxt is not None:
                key = self._key(nxt, self._share(team) if drf else 0.0)
                heapq.heappush(heap, (key, version[team], team, shape, nxt, it))
