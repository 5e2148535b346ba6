"""Nominal deficit: how long, and by how many GPUs, a team sat below its nominal quota while it
had work that fitted there and other teams were borrowing (docs/simulator.md, "Nominal deficit").

At each instant team T's rate is min(N_T - used_T, GPUs still needed by T's pending jobs that
each need at most N_T - used_T, GPUs the other teams use above their nominal), where positive;
integrated over the run it is the summary's `nominal_deficit_gpu_hours`. A team below its
nominal borrows nothing, so the borrowing of all teams stands for the others' borrowing.

`metrics.py`'s event replay owns one `NominalDeficit` and tells it what changes: each pending
job's need, each team's allocation, and the time between events.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

__all__ = ["NominalDeficit"]

_EPS = 1e-9  # GPUs: running sums of shares drift by float rounding, not by real GPUs


class NominalDeficit:
    """Pending need and allocation per team, and each team's deficit integrated over time.

    Pending need is kept per team as size -> count with the sizes in ascending order: few
    distinct sizes, so the GPUs that fit a gap are summed without a scan over jobs. The rates
    are recomputed only when something they depend on changed since the last interval.
    """

    def __init__(self, nominal: Mapping[str, float]) -> None:
        self._nominal = dict(nominal)
        self._sizes: dict[str, dict[float, int]] = {}  # team -> pending need size -> jobs
        self._order: dict[str, list[float]] = {}  # team -> those sizes, ascending
        self._alloc: dict[str, float] = {}
        self._borrowed = 0.0  # GPUs all teams use above their nominal
        self._rates: dict[str, float] = {}
        self._stale = False
        self._gpu_s: dict[str, float] = {}

    def move_need(self, team: str, before: float, after: float) -> None:
        """One pending job of `team` now still needs `after` GPUs instead of `before`.

        0 means none: a job enters the pending work from 0 and leaves it to 0 (it runs, or is
        done). The caller keeps each job's current need.
        """
        if after == before:
            return
        self._stale = True
        sizes = self._sizes.setdefault(team, {})
        order = self._order.setdefault(team, [])
        if before:
            left = sizes[before] - 1
            if left:
                sizes[before] = left
            else:
                del sizes[before]
                order.remove(before)
        if after:
            count = sizes.get(after, 0)
            if not count:
                bisect.insort(order, after)
            sizes[after] = count + 1

    def set_allocation(self, team: str, gpus: float) -> None:
        """`team` now holds `gpus` GPUs (admitted or held); updates the borrowed total."""
        self._stale = True
        before = self._alloc.get(team, 0.0)
        self._alloc[team] = gpus
        nom = self._nominal.get(team, 0.0)
        self._borrowed += max(gpus - nom, 0.0) - max(before - nom, 0.0)

    def advance(self, dt: float) -> None:
        """Integrate over `dt` seconds the rates the changes so far put in force (the replay
        calls it when time moves on from one event time to the next)."""
        if self._stale:
            self._rates = self._deficit_rates()
            self._stale = False
        for team, rate in self._rates.items():
            self._gpu_s[team] = self._gpu_s.get(team, 0.0) + rate * dt

    def gpu_hours(self, team: str) -> float:
        """`team`'s deficit integrated so far, in GPU-hours."""
        return self._gpu_s.get(team, 0.0) / 3600.0

    def _deficit_rates(self) -> dict[str, float]:
        """Each team's deficit rate, GPUs, where positive (see the module docstring)."""
        rates: dict[str, float] = {}
        borrowed = self._borrowed
        if borrowed <= _EPS:
            return rates
        nominal, alloc = self._nominal, self._alloc
        for team, order in self._order.items():
            if not order:
                continue
            gap = nominal.get(team, 0.0) - alloc.get(team, 0.0)
            if gap <= _EPS:
                continue
            cap = min(gap, borrowed)
            sizes, fits = self._sizes[team], 0.0
            for size in order:
                if size > gap + _EPS:
                    break
                fits += size * sizes[size]
                if fits >= cap:  # the rest cannot raise the minimum
                    break
            rate = min(cap, fits)
            if rate > _EPS:
                rates[team] = rate
        return rates
