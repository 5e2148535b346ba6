"""An SRTF oracle: a reference for JCT and waits that no real scheduler reaches.

All of the cluster's GPUs form one pool (no nodes, no topology, no quotas, no CPUs or memory),
every job's true duration is known, and preemption and migration are free and instant. At
every arrival and every completion the jobs run shortest remaining time first: going down the
list of jobs by remaining time, each job runs if its GPUs (all of them at once: a gang never
runs in part) fit in what is left, and is skipped otherwise, the rest of the list going on.
A share of one GPU takes its fraction of the pool. Metrics follow docs/simulator.md: JCT =
finish - submit, first wait = first start - submit, total wait = every span not running.

Cost: the greedy pass is not redone in full at each event. Two facts make it incremental:
(1) between events the running jobs' remaining times fall while the waiting ones' stay, which
keeps the last pass's result a valid pass at any later time (a running job only moves up the
list, past jobs that did not fit before it); (2) within one size of job a pass takes a prefix
by remaining time, so for each size only the first waiting job can change state. An event
therefore changes the pass from its own position on, and the difference (`gap`: free GPUs of
the new pass minus those of the old, at the same point of the list) decides what changes: while
it is negative only running jobs may stop, found by bisecting the old pass's prefix sums; while
positive only the first waiting job of each size may start; at zero the passes agree from there
on. Each event costs a few bisections per job size plus the rebuilt prefix sums, so 6,000 Philly
jobs take well under a second.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
from sortedcontainers import SortedList

from scheduling.simulator.trace import TraceJob

__all__ = ["OracleResult", "srtf"]

_MILLI = 1000  # pool sizes in thousandths of a GPU, as the engine counts them: sums stay exact


@dataclass(frozen=True)
class OracleResult:
    """Per job (in trace order): submit, first start and finish times (NaN: never ran, the job
    is wider than the pool), GPUs, duration and how often it was preempted; and the pool size.
    """

    job_ids: tuple[str, ...]
    submit: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    gpus: np.ndarray
    duration: np.ndarray
    preempted: np.ndarray
    total_gpus: float

    @property
    def jct(self) -> np.ndarray:
        """finish - submit; NaN for a job that never ran."""
        return self.finish - self.submit

    @property
    def first_wait(self) -> np.ndarray:
        """first start - submit; NaN for a job that never ran."""
        return self.start - self.submit

    def summary(self) -> dict[str, Any]:
        """The metrics.py keys that make sense for a pool: JCT, waits, preemptions, makespan."""
        ran = ~np.isnan(self.finish)
        jct, wait = np.sort(self.jct[ran]), np.sort(self.first_wait[ran])
        # Nothing slows a run down and restarts are free: every second not running is a wait.
        total_wait = np.sort(jct - self.duration[ran])
        last = float(self.finish[ran].max()) if ran.any() else 0.0
        first = float(self.submit.min()) if self.submit.size else 0.0
        return {
            "policy": "oracle-srtf",
            "jobs": int(self.submit.size),
            "finished": int(ran.sum()),
            "unrunnable": int((~ran).sum()),
            "preemptions": int(self.preempted.sum()),
            "avg_jct_s": _stat(jct, None),
            "p50_jct_s": _stat(jct, 50),
            "p99_jct_s": _stat(jct, 99),
            "avg_first_wait_s": _stat(wait, None),
            "p50_first_wait_s": _stat(wait, 50),
            "p99_first_wait_s": _stat(wait, 99),
            "avg_total_wait_s": _stat(total_wait, None),
            "p99_total_wait_s": _stat(total_wait, 99),
            "makespan_s": round(max(last - first, 0.0), 3),
            "total_gpus": self.total_gpus,
        }


def _stat(values: np.ndarray, pct: float | None) -> float | None:
    if not values.size:
        return None
    value = values.mean() if pct is None else np.percentile(values, pct)
    return round(float(value), 3)


def srtf(
    trace: Sequence[TraceJob], total_gpus: float, speed: Sequence[float] | None = None
) -> OracleResult:
    """Run `trace` on one pool of `total_gpus` GPUs, shortest remaining time first.

    Events at one instant: completions first, then arrivals in trace order; what counts is
    the pass after the instant's last event (as the simulator runs one cycle after all of an
    instant's events). A job wider than the pool never runs (its start and finish are NaN).
    `speed`: per job, how much faster than its duration it runs (on a cluster of several GPU
    models: the fastest it accepts, every GPU of the pool being of it, still a floor).
    """
    return _Srtf(trace, total_gpus, speed).run()


class _Srtf:
    """State of the oracle between events. Jobs are trace indices.

    Running jobs are a list sorted by (finish time, index), with the prefix sums of their
    sizes; waiting jobs are one SortedList per size, by (remaining time, index). A running
    job's remaining time is finish - now, so its place in the merged list at time `now` is
    found by comparing its finish with now + a waiting job's remaining time.
    """

    def __init__(
        self, trace: Sequence[TraceJob], total_gpus: float, speed: Sequence[float] | None = None
    ) -> None:
        self.trace = trace
        self.total_gpus = float(total_gpus)
        self.cap = round(total_gpus * _MILLI)
        self.size = [round(j.replicas * j.gpus_per_replica * _MILLI) for j in trace]
        speed = speed or [1.0] * len(trace)
        self.remaining = [float(j.duration) / s for j, s in zip(trace, speed, strict=True)]
        self.run_s = list(self.remaining)  # each job's run time in the pool
        n = len(trace)
        self.start = [math.nan] * n
        self.finish = [math.nan] * n
        self.preempted = [0] * n
        # Changes within the current instant: a job stopped by one event and started again by
        # the next one at the same time kept running, and one started and stopped at once
        # never ran; only the net change counts as a start or a preemption.
        self.started_now: set[int] = set()
        self.stopped_now: set[int] = set()
        self.running: list[tuple[float, int]] = []
        self.prefix: list[int] = [0]
        self.waiting: dict[int, SortedList] = {}
        self.now = 0.0

    def run(self) -> OracleResult:
        trace = self.trace
        arrivals = sorted(
            (i for i, j in enumerate(trace) if self.size[i] <= self.cap),
            key=lambda i: trace[i].submit_time,
        )
        a = 0
        while a < len(arrivals) or self.running:
            next_arrival = trace[arrivals[a]].submit_time if a < len(arrivals) else math.inf
            now = self.now = min(next_arrival, self.running[0][0] if self.running else math.inf)
            while self.running and self.running[0][0] <= now:
                self._complete()
            while a < len(arrivals) and trace[arrivals[a]].submit_time <= now:
                self._arrive(arrivals[a])
                a += 1
            self._settle()
        assert not any(self.waiting.values()), "a job that fits the pool was left waiting"
        return OracleResult(
            job_ids=tuple(j.job_id for j in trace),
            submit=np.fromiter((j.submit_time for j in trace), float, len(trace)),
            start=np.array(self.start, dtype=float),
            finish=np.array(self.finish, dtype=float),
            gpus=np.array(self.size, dtype=float) / _MILLI,
            duration=np.array(self.run_s, dtype=float),
            preempted=np.array(self.preempted, dtype=np.int64),
            total_gpus=self.total_gpus,
        )

    def _arrive(self, job: int) -> None:
        if self.size[job] not in self.waiting:
            self.waiting[self.size[job]] = SortedList()
        key = (self.now + self.remaining[job], job)
        r = bisect.bisect_left(self.running, key)
        if self.cap - self.prefix[r] < self.size[job]:
            self._wait(job)  # skipped at its place in the list: nothing else changes
            return
        self._rebalance(-self.size[job], r, key, started=[job], stopped=[])

    def _complete(self) -> None:
        finish, job = self.running[0]
        self.finish[job] = finish
        self._rebalance(self.size[job], 1, (finish, job), started=[], stopped=[0])

    def _rebalance(
        self,
        gap: int,
        r: int,
        key: tuple[float, int],
        started: list[int],
        stopped: list[int],
    ) -> None:
        """Redo the greedy pass from `key` on, given the old pass (the running list).

        `gap` is the new pass's free GPUs minus the old one's just after `key`, `r` the number
        of running jobs before that point. `started` (jobs) and `stopped` (running positions)
        already hold the event's own change; the pass's other changes are added, then applied.
        """
        cap, prefix, running, size = self.cap, self.prefix, self.running, self.size
        closed: set[int] = set()  # sizes none of whose waiting jobs start in this pass
        # Per size, the first waiting job not yet passed: the pass only moves down the list,
        # and a job just started must not be found again through rounding of now + remaining.
        cursor: dict[int, int] = {}
        while gap:
            if gap < 0:
                # The first running job after `key` that no longer fits: the old pass's free
                # GPUs after it (cap - prefix[j + 1]) are below what the new pass lacks.
                j = bisect.bisect_right(prefix, cap + gap, lo=r + 1) - 1
                if j >= len(running):
                    break
                stopped.append(j)
                gap += size[running[j][1]]
                closed.add(size[running[j][1]])
                key, r = running[j], j + 1
                continue
            free = cap - prefix[r] + gap  # the new pass's free GPUs at this point
            best: tuple[float, int] | None = None
            for s, jobs in self.waiting.items():
                if s in closed or not jobs:
                    continue
                if s > free:  # free only falls further down the list
                    closed.add(s)
                    continue
                k = max(cursor.get(s, 0), jobs.bisect_right((key[0] - self.now, key[1])))
                cursor[s] = k
                if k < len(jobs):
                    rem, job = jobs[k]
                    candidate = (self.now + rem, job)
                    if best is None or candidate < best:
                        best = candidate
            if best is None:
                break
            job = best[1]
            cursor[size[job]] += 1
            r = bisect.bisect_left(running, best)
            if cap - prefix[r] + gap >= size[job]:
                started.append(job)
                gap -= size[job]
            else:
                closed.add(size[job])
            key = best
        self._apply(started, stopped)

    def _apply(self, started: list[int], stopped: list[int]) -> None:
        now = self.now
        for j in sorted(stopped, reverse=True):
            finish, job = self.running.pop(j)
            if not math.isnan(self.finish[job]):
                continue  # it completed
            self.remaining[job] = finish - now
            self._wait(job)
            if job in self.started_now:
                self.started_now.discard(job)
            else:
                self.stopped_now.add(job)
        for job in started:
            self.waiting[self.size[job]].discard((self.remaining[job], job))
            bisect.insort(self.running, (now + self.remaining[job], job))
            if job in self.stopped_now:
                self.stopped_now.discard(job)
            else:
                self.started_now.add(job)
        size = self.size
        self.prefix = list(accumulate((size[job] for _, job in self.running), initial=0))

    def _settle(self) -> None:
        """Record the instant's net changes: first starts and preemptions."""
        for job in self.started_now:
            if math.isnan(self.start[job]):
                self.start[job] = self.now
        for job in self.stopped_now:
            self.preempted[job] += 1
        self.started_now.clear()
        self.stopped_now.clear()

    def _wait(self, job: int) -> None:
        self.waiting[self.size[job]].add((self.remaining[job], job))
