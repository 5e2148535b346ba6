"""Replay a trace through the engine with a virtual clock.

The loop is the production loop with time made up: events arrive (submissions, finishes,
timeouts), the state changes, one scheduling cycle runs on a snapshot, its decisions are
applied. The cycle is the same function production calls; only the clock and the runtime differ.

Run time depends on placement: a job admitted at a level with slowdown s finishes
`remaining work x s` later. Preempted work restarts from zero, or from the last checkpoint when a
checkpoint interval is set; a restart is not free either: a preempted job, admitted again, first
spends `restart_cost_s` (times its slowdown) reloading before its work goes on.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from scheduling.admission import check_job
from scheduling.cluster import Cluster
from scheduling.cycle import schedule
from scheduling.jobs import Job, Placement
from scheduling.mig import share_of
from scheduling.models import models_of
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.resources import Resources
from scheduling.run_times import RunTimes
from scheduling.shortcuts import FAST, Shortcuts, rerun_settles
from scheduling.simulator.trace import TraceJob
from scheduling.state import EngineState

_FINISH, _TICK, _SUBMIT = 0, 1, 2  # at one instant: free first, then time-outs, then arrivals

Progress = Callable[[int, int], None]  # (jobs settled, jobs in all)


@dataclass(frozen=True)
class SimulationResult:
    policy: str
    events: list[dict]
    wall_s: float
    cycles: int
    unfinished: int


# Seconds a preempted job spends reloading (image, data, checkpoint) at its next admission.
RESTART_COST_S = 60.0


# A job preempted this often is in a preemption cycle that will not end (the most we saw in
# a real replay: 463 times, in 30,000 Philly jobs): the replay stops with an error, not running
# for ever (docs/decisions/0003, "Kueue's victim rule").
MAX_ATTEMPTS = 10_000


class Livelock(RuntimeError):
    """The replay cannot end: jobs preempt one another in a cycle."""


def to_job(t: TraceJob, checkpoint_s: float | None = None) -> Job:
    """A trace row in engine units; `checkpoint_s` for a row that gives none."""
    r = Resources.of(t.gpus_per_replica, t.cpus_per_replica, t.memory_gb_per_replica)
    return Job(
        id=t.job_id,
        team=t.team,
        replicas=t.replicas,
        gpu=share_of(t.mig_profile) if t.mig_profile else r.gpu,
        cpu=r.cpu,
        mem=r.mem,
        priority=t.priority,
        topology=t.topology,
        preemptible=t.preemptible,
        submit_time=t.submit_time,
        time_limit_s=math.inf if t.time_limit_s is None else t.time_limit_s,
        checkpoint_s=next((s for s in (t.checkpoint_s, checkpoint_s) if s is not None), math.inf),
        gpu_models=t.gpu_models,
        mixed_models=t.mixed_models,
        mig=t.mig_profile or "",
    )


def _placement_json(cluster: Cluster, p: Placement | tuple) -> list[dict]:
    reps = p.replicas if isinstance(p, Placement) else p
    out = []
    for r in reps:
        entry: dict = {"node": cluster.nodes[r.node].name, "gpus": list(r.gpus)}
        if r.share:
            entry["share"] = r.share / 1000
        if r.instance >= 0:  # a MIG instance: its index on the node, and its profile
            entry["instance"] = r.instance
            entry["mig"] = cluster.nodes[r.node].mig[r.instance][1]
        out.append(entry)
    return out


def simulate(
    cluster: Cluster,
    teams: Mapping[str, Team],
    trace: Sequence[TraceJob],
    policy: Policy,
    *,
    checkpoint_s: float | None = None,
    restart_cost_s: float = RESTART_COST_S,
    progress: Progress | None = None,
    shortcuts: Shortcuts = FAST,
    observe: Callable[[float, EngineState, list[dict]], None] | None = None,
) -> SimulationResult:
    """Run the whole trace; returns the event log (see docs/simulator.md for its format).

    ``restart_cost_s`` is the ideal seconds a preempted job spends at its next admission
    before it makes progress again (loading its image, data and checkpoint); the admit event
    records it as ``restart_s`` and the preempt event the work its checkpoint kept as
    ``kept_s``, so the metrics can count the work preemption lost. Raises ``ValueError`` on a
    negative or non-finite restart cost. ``shortcuts``: ``EXACT`` runs every cycle without
    the engine's speed shortcuts (scheduling/shortcuts.py), to check that they change nothing.
    ``observe(t, state, events)`` is called at each new instant before its events, with the
    state and the event log as the instants before left them (read them, do not change them).
    """
    if not (math.isfinite(restart_cost_s) and restart_cost_s >= 0):
        raise ValueError(f"restart_cost_s must be a finite number >= 0, got {restart_cost_s}")
    if checkpoint_s is not None and not 0 < checkpoint_s < math.inf:
        raise ValueError(f"checkpoint_s must be a number of seconds > 0, got {checkpoint_s}")
    started = time.perf_counter()
    state = EngineState(cluster, teams, policy)
    if policy.expected_finish_models:
        # What the cycle's choice between GPU models reads: the runs that ended, in ideal
        # seconds (at speed 1), as the store learns them from its finished attempts.
        state.run_times = RunTimes()
    jobs = {t.job_id: to_job(t, checkpoint_s) for t in trace}
    duration = {t.job_id: t.duration for t in trace}
    work_left = dict(duration)  # ideal seconds still to run
    attempt: dict[str, int] = {}
    # job -> (admit t, slowdown, restart, speed of its GPU model)
    started_at: dict[str, tuple[float, float, float, float]] = {}
    restart_due: set[str] = set()  # preempted jobs: their next admission pays the restart
    heap: list[tuple] = []
    seq = 0
    for t in trace:
        heap.append((t.submit_time, _SUBMIT, seq, t.job_id))
        seq += 1
    heapq.heapify(heap)
    events: list[dict] = []
    emit = events.append
    ticks: set[float] = set()
    settled = cycles = 0
    total = len(trace)

    last = None  # the last cycle's result: new jobs it already settles need no new cycle
    observed = -math.inf
    while heap:
        if observe is not None and heap[0][0] != observed:
            observed = heap[0][0]
            observe(observed, state, events)
        now = heap[0][0]
        changed = False
        while heap and heap[0][0] == now:
            _, kind, _, payload = heapq.heappop(heap)
            if kind == _FINISH:
                job_id, token, timed_out = payload
                if attempt.get(job_id) != token:
                    continue  # preempted since this finish was planned
                job = state.finish(job_id).job
                admitted, slowdown, restart, speed = started_at.pop(job_id)
                if state.run_times is not None:
                    ideal = max(0.0, (now - admitted) / slowdown - restart) * speed
                    state.run_times.add(job.team, ideal)
                ended = {"t": now, "type": "finish", "job": job_id, "team": job.team}
                if timed_out:  # stopped at its time limit, its work undone
                    ended["timed_out"] = True
                emit(ended)
                settled += 1
            elif kind == _SUBMIT:
                job = jobs[payload]
                emit(
                    {
                        "t": now,
                        "type": "submit",
                        "job": job.id,
                        "team": job.team,
                        "replicas": job.replicas,
                        "gpus_per_replica": job.gpu / 1000,
                        "gpus": job.demand.gpu / 1000,
                        "duration": duration[job.id],
                        "priority": job.priority,
                    }
                )
                rejection = check_job(job, cluster, teams, quotas=policy.quotas)
                if rejection is not None:
                    emit(
                        {
                            "t": now,
                            "type": "reject",
                            "job": job.id,
                            "team": job.team,
                            "reason": rejection.reason,
                            "field": rejection.field,
                            "message": rejection.message,
                        }
                    )
                    settled += 1
                    continue
                state.submit(job, now)
                if last is not None and last.settles(job):
                    continue
            else:
                ticks.discard(now)
            changed = True
        if policy.las:
            # Least attained service: jobs that had their share of service go below their
            # priority's others before the cycle (EngineState.demote_due).
            for run in state.demote_due(now):
                emit(
                    {
                        "t": now,
                        "type": "demote",
                        "job": run.job.id,
                        "team": run.job.team,
                        "attained_gpu_s": state.attained_s(run, now),
                    }
                )
                changed = True
                last = None  # it settled jobs against the ranks before
            for p in state.promote_due(now):  # up to their priority, for good
                emit(
                    {
                        "t": now,
                        "type": "promote",
                        "job": p.job.id,
                        "team": p.job.team,
                        "waited_s": now - p.since,
                    }
                )
                changed = True
                last = None
        if not changed or not (state.pending or state.holds):
            continue
        result = last = schedule(state.snapshot(now), policy, shortcuts)
        cycles += 1
        state.apply(result)
        rerun = None
        if not result.fixed_point and shortcuts.on:
            rerun = rerun_settles(result, state, policy)  # the rerun would change nothing
            if rerun is not None:
                last = rerun
        if not result.fixed_point and now not in ticks and rerun is None:
            # A cycle that changed something is run again at once, until one changes nothing
            # (as a production loop runs while there is work): after a preemption, classes
            # closed before it freed room get their turn; after an admission, the shares and
            # the order moved, and a job admitted just now may be a victim. Without it, what
            # happens next would hang on when an unrelated event comes.
            ticks.add(now)
            heapq.heappush(heap, (now, _TICK, seq, None))
            seq += 1
        for ev in result.evicted:
            team = jobs[ev.job_id].team
            emit({"t": now, "type": "evict", "job": ev.job_id, "team": team, "reason": ev.reason})
        for pre in result.preempted:
            job_id = pre.job_id
            admitted, slowdown, restart, speed = started_at.pop(job_id)
            # Checkpoints count from the end of the restart: reloading saves nothing new. Work
            # is ideal seconds (at speed 1): a faster model does more of it per second.
            done = max(0.0, (now - admitted) / slowdown - restart) * speed
            every = jobs[job_id].checkpoint_s  # the row's interval, else `checkpoint_s`
            kept = math.floor(done / every) * every if every != math.inf else 0.0
            work_left[job_id] -= kept
            attempt[job_id] += 1  # invalidates the planned finish
            if attempt[job_id] > MAX_ATTEMPTS:
                raise Livelock(
                    f"policy {policy.name}: job {job_id} was preempted {MAX_ATTEMPTS:,} times"
                    f" (t={now:g}s); its policy lets jobs preempt one another in a cycle"
                    " that never ends"
                )
            if restart_cost_s:
                restart_due.add(job_id)
            emit(
                {
                    "t": now,
                    "type": "preempt",
                    "job": job_id,
                    "team": jobs[job_id].team,
                    "by": pre.by,
                    "kept_s": kept,
                }
            )
        for hu in result.holds:
            emit(
                {
                    "t": now,
                    "type": "hold",
                    "job": hu.job.id,
                    "team": hu.job.team,
                    "placement": _placement_json(cluster, hu.bound),
                }
            )
        for adm in result.admitted:
            job = adm.job
            slowdown = cluster.slowdown_of(adm.placement.level)
            token = attempt.get(job.id, 0) + 1
            attempt[job.id] = token
            restart = restart_cost_s if job.id in restart_due else 0.0
            restart_due.discard(job.id)
            speed = cluster.speed_of(r.node for r in adm.placement.replicas)
            started_at[job.id] = (now, slowdown, restart, speed)
            run = (work_left[job.id] / speed + restart) * slowdown
            timed_out = run > job.time_limit_s  # the runtime stops it at its limit
            end = now + (job.time_limit_s if timed_out else run)
            heapq.heappush(heap, (end, _FINISH, seq, (job.id, token, timed_out)))
            seq += 1
            admit_ev = {
                "t": now,
                "type": "admit",
                "job": job.id,
                "team": job.team,
                "placement": _placement_json(cluster, adm.placement),
                "level": adm.placement.level,
                "slowdown": slowdown,
                "gpu_model": "|".join(models_of(cluster, (r.node for r in adm.placement.replicas))),
            }
            if restart:
                admit_ev["restart_s"] = restart
            if speed != 1.0:
                admit_ev["speed"] = speed
            emit(admit_ev)
        wakes = [result.next_wakeup]
        if policy.las:
            wakes.append(state.next_las_change())  # a job waiting on it may then preempt
        if rerun is not None and not (heap and heap[0][0] == now):
            # The skipped rerun's wake-up, as if it had run. Not when a job admitted just
            # now ends at once: the cycle its end runs now is the rerun, with its own.
            wakes.append(rerun.next_wakeup)
        for wake in wakes:
            if wake is not None and wake > now and wake not in ticks:
                ticks.add(wake)
                heapq.heappush(heap, (wake, _TICK, seq, None))
                seq += 1
        if progress is not None and cycles % 2000 == 0:
            progress(settled, total)
    if progress is not None:
        progress(settled, total)
    return SimulationResult(
        policy=policy.name,
        events=events,
        wall_s=time.perf_counter() - started,
        cycles=cycles,
        unfinished=total - settled,
    )
