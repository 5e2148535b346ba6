"""The step functions the report's plots are drawn from, and their bucketing.

The metrics replay (`metrics_replay.Replay`) records the queue length, the allocated and
busy GPUs and each team's allocated GPUs as step functions, one point per distinct event
time; `Timeline.bucketed` turns them into at most ``max_points`` time-weighted means, so a
plot of a long run stays small while its area (GPU-seconds) stays exact. Apart from the
summary figures because it is the one part of a summary that is a shape over time, not a
number.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

__all__ = ["Timeline", "bucket_means", "step_integral"]


class Timeline:
    """The recorded step functions: the cluster's (queue, allocated, busy) and each team's
    allocated GPUs. A value holds from its time until the next point's."""

    def __init__(self) -> None:
        self.ts, self.qs, self.als, self.bus = array("d"), array("d"), array("d"), array("d")
        self.team_pts: dict[str, tuple[array, array]] = {}

    def sample(self, t: float, queue: float, allocated: float, busy: float) -> None:
        """The cluster's state from ``t`` on; a later sample at the same ``t`` replaces it."""
        if self.ts and self.ts[-1] == t:
            self.qs[-1], self.als[-1], self.bus[-1] = queue, allocated, busy
        else:
            self.ts.append(t)
            self.qs.append(queue)
            self.als.append(allocated)
            self.bus.append(busy)

    def set_team(self, team: str, t: float, gpus: float, origin: float) -> None:
        """``team``'s allocated GPUs from ``t`` on; a new team's series is 0 from ``origin``."""
        if team not in self.team_pts:
            self.team_pts[team] = (array("d", [origin]), array("d", [0.0]))
        pts_t, pts_v = self.team_pts[team]
        if pts_t[-1] == t:
            pts_v[-1] = gpus
        else:
            pts_t.append(t)
            pts_v.append(gpus)

    def team_gpu_seconds(self, team: str) -> float:
        """The team's GPU-seconds up to its last point; 0 for a team that never held a GPU."""
        return step_integral(*self.team_pts[team]) if team in self.team_pts else 0.0

    def bucketed(
        self, names: list[str], start: float, makespan: float, max_points: int
    ) -> dict[str, Any]:
        """The recorded step functions as at most ``max_points`` time-weighted means."""
        buckets = max(1, max_points) if makespan > 0 else 0
        edges = np.linspace(start, start + makespan, buckets + 1)
        t = np.frombuffer(self.ts)
        team_gpus = {name: np.zeros(edges.size - 1) for name in names}
        for name, (pt, pv) in self.team_pts.items():
            team_gpus[name] = bucket_means(np.frombuffer(pt), np.frombuffer(pv), edges)
        return {
            "t_s": (edges[:-1] + edges[1:]) / 2 - start,
            "queue_len": bucket_means(t, np.frombuffer(self.qs), edges),
            "allocated_gpus": bucket_means(t, np.frombuffer(self.als), edges),
            "busy_gpus": bucket_means(t, np.frombuffer(self.bus), edges),
            "team_gpus": team_gpus,
        }


def bucket_means(t: np.ndarray, v: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Time-weighted mean per bucket of the step function that is ``v[i]`` from ``t[i]``."""
    if t.size == 0:
        return np.zeros(max(edges.size - 1, 0))
    integral = np.concatenate(([0.0], np.cumsum(v[:-1] * np.diff(t))))
    return np.diff(np.interp(edges, t, integral, left=0.0)) / np.diff(edges)


def step_integral(t: array, v: array) -> float:
    """Integral of the step function that is ``v[i]`` from ``t[i]`` up to ``t[-1]``."""
    tt, vv = np.frombuffer(t), np.frombuffer(v)
    return float((vv[:-1] * np.diff(tt)).sum())
