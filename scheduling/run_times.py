"""How long runs last: each team's recent finished runs, for what the engine must guess.

Two readers: the ETA's forward run (`scheduling/eta.py`) and the cycle's choice between a
slower GPU model now and a faster one soon (`scheduling/model_choice.py`). Both want the
expected value (the mean), not the median: an expected finish is what is compared, and with
the heavy tails of GPU run times the mean is far above the median.

Seconds are as the platform measured them. The simulator feeds ideal seconds (at a speed of
1.0), so that runs on GPU models of other speeds are comparable; the store feeds wall seconds
(docs/decisions/0022).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

# A running job that has outlived every run seen is taken to run as long again as it has (for
# heavy-tailed run times, about the median of what is left, given its age); without any
# history, at least this long, as is a new job.
DEFAULT_RUN_S = 3600.0


class RunTimes:
    """Each team's recent run times (seconds of finished runs), for jobs without a limit.

    The last `window` runs of each team, sorted: how long a job runs on is the mean of its
    team's runs that lasted longer than it has run so far, less what it has run (the mean
    residual life), and a new job's run the mean of them all. A team without history borrows
    the whole cluster's. The mean of each tail is worked out once until the next run is added:
    a cycle may ask for thousands of running jobs at once."""

    def __init__(self, window: int = 500) -> None:
        self.window = window
        self._recent: dict[str, deque[float]] = {}
        self._sorted: dict[str, list[float]] = {}
        self._all: list[float] = []
        self._all_recent: deque[float] = deque()
        # team (None: the cluster's) -> {start index: mean of its sorted runs from there};
        # a team's is cleared when it adds a run, the cluster's on every add
        self._tails: dict[str | None, dict[int, float]] = {}

    def add(self, team: str, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        recent = self._recent.setdefault(team, deque())
        runs = self._sorted.setdefault(team, [])
        _push(recent, runs, seconds, self.window)
        _push(self._all_recent, self._all, seconds, self.window * 4)
        self._tails.pop(team, None)
        self._tails.pop(None, None)

    def remaining(self, team: str, elapsed: float) -> float:
        """How much longer a run of the team that has lasted `elapsed` seconds will last."""
        for key, runs in ((team, self._sorted.get(team) or []), (None, self._all)):
            i = bisect.bisect_right(runs, elapsed)
            if i < len(runs):
                return self._tail_mean(key, runs, i) - elapsed
        if self._all:
            return elapsed  # longer than any run seen: as long again
        return max(elapsed, DEFAULT_RUN_S)

    def typical(self, team: str) -> float:
        """How long a new run of the team lasts: the mean of its runs."""
        key, runs = (team, self._sorted[team]) if self._sorted.get(team) else (None, self._all)
        return self._tail_mean(key, runs, 0) if runs else DEFAULT_RUN_S

    def _tail_mean(self, key: str | None, runs: list[float], i: int) -> float:
        tails = self._tails.setdefault(key, {})
        mean = tails.get(i)
        if mean is None:
            mean = tails[i] = statistics.fmean(runs[i:])
        return mean


def _push(recent: deque[float], runs: list[float], seconds: float, window: int) -> None:
    recent.append(seconds)
    bisect.insort(runs, seconds)
    if len(recent) > window:
        old = recent.popleft()
        del runs[bisect.bisect_left(runs, old)]
