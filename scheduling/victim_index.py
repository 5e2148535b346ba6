"""Victims by node, for the search that makes room on one node for a single-replica job.

Building it walks every candidate victim (thousands on a busy cluster), and a cycle in which a
team reclaims runs that search once per job it admits: 24 of them in one 2,000-node cycle of
`bench.cycle_bench`, each over the same candidates less the victims the ones before took. So a
cycle keeps the index it built (shortcut 6 in `scheduling/shortcuts.py`) and takes out the
victims preempted since, instead of building it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set

from scheduling.jobs import Running
from scheduling.resources import ZERO, Resources

# One candidate on one node: (victim, whole GPUs it holds there, its replicas there).
Entry = tuple[Running, int, int]


class NodeIndex:
    """Candidates (in loss order) by node, what each node's candidates hold, and what those of
    the preemptor's team give back to its quota; the candidates excluded are left out."""

    __slots__ = ("_candidates", "_excluded", "_runs", "by_node", "freeable", "own", "team")

    def __init__(
        self,
        candidates: Sequence[Running],
        team: str,
        excluded: Set[str],
        *,
        more: Sequence[Sequence[Running]] = (),
        key: Callable[[Running], tuple] | None = None,
    ) -> None:
        """`candidates` in loss order; `more`: further lists of other teams' candidates, each
        in loss order (`key`'s), merged per node only where several lists meet on one node:
        sorting a few short lists costs less than sorting all of them together first."""
        self.team = team
        self.by_node: dict[int, list[Entry]] = {}
        self.freeable: dict[int, int] = {}  # node -> GPUs all its candidates hold
        self.own: Resources = ZERO  # ZERO itself when no candidate is of `team`
        # By id, made when a later search first takes some out (most indexes serve one).
        self._runs: dict[str, Running] | None = None
        self._candidates = [*candidates, *(r for rs in more for r in rs)] if more else candidates
        self._excluded = frozenset(excluded)
        by_node, freeable = self.by_node, self.freeable
        mixed: set[int] = set()  # nodes where entries of several lists meet
        origin: dict[int, int] = {}  # node -> the list its first entry came from
        for i, runs in enumerate((candidates, *more)):
            for r in runs:
                if i == 0 and r.job.team == team:
                    self.own = self.own + r.job.demand
                if r.shares_gpu:
                    continue  # freeing a share may not free a whole GPU; the greedy search does
                for n, k, reps in r.node_entries:
                    entry = by_node.get(n)
                    if entry is None:
                        by_node[n] = [(r, k, reps)]
                        freeable[n] = k
                        if more:
                            origin[n] = i
                    else:
                        entry.append((r, k, reps))
                        freeable[n] += k
                        if i and origin[n] != i:
                            mixed.add(n)
        if mixed:
            assert key is not None, "several candidate lists need the loss order's key"
            for n in mixed:
                by_node[n].sort(key=lambda e: key(e[0]))

    def __bool__(self) -> bool:
        return bool(self._candidates if self._runs is None else self._runs)

    def catch_up(self, excluded: Set[str]) -> bool:
        """Take out the candidates excluded since the index was made (victims only accumulate
        in a cycle); False if some it had excluded are not any more (then make a new one)."""
        if not self._excluded <= excluded:
            return False
        if len(excluded) == len(self._excluded):
            return True
        if self._runs is None:
            self._runs = {r.job.id: r for r in self._candidates}
        for job_id in excluded - self._excluded:
            r = self._runs.pop(job_id, None)
            if r is None:
                continue  # not a candidate of this index
            if r.job.team == self.team:
                self.own = self.own - r.job.demand
                if self.own == ZERO:
                    self.own = ZERO  # the search tests `own is not ZERO`
            if r.shares_gpu:
                continue
            for n, k in r.gpus_by_node:
                entries = [e for e in self.by_node[n] if e[0] is not r]
                if entries:
                    self.by_node[n] = entries
                    self.freeable[n] -= k
                else:
                    del self.by_node[n]
                    del self.freeable[n]
        self._excluded = frozenset(excluded)
        return True
