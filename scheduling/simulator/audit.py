"""Replay a simulator event log and check the engine's invariants at every instant.

The audit rebuilds GPU, CPU, memory and quota usage from the events and the trace alone, so a
bug in `Capacity` or `QuotaLedger` shows up here instead of being trusted. `Violation.rule`:
`over_allocation` (a GPU, share, CPU or memory given twice), `gang` (an admit that is not the
whole gang), `topology` (a wrong or too wide level), `quota` (a team above nominal + borrowing,
the cohort lending more than its teams lend, or a non-preemptible job above its team's
nominal), `preemption` (a victim the rules protect, a victim's team left below nominal, a
reclaim by a team that would then be above its nominal, a preemptor that had not waited
`preemption_delay_s`), `inversion` (a job preempted in a cycle that admits a lower-priority
job of its team), `rejection` (a rejected job that could run on the empty cluster within its
team's reach), `duration` (a run that did not last duration x slowdown, or one not stopped
exactly at its time limit), `liveness` (a job neither rejected nor finished at the end),
`demotion` (least attained service: a job demoted before its threshold, or one that does
not checkpoint; a job promoted back before it waited its due, or demoted again after),
`lifecycle` (an event that does not fit the job's state, or time going back), `gpu_model` (a
replica on a GPU model the job does not accept, or a gang on several models that did not ask
for mixed ones) and `nominal_deficit` (a lender's job left waiting past
`Policy.reclaim_bound_s` while a borrowed job could make room for it: `audit_deficit.py`).

This module holds the replay: `_Auditor` walks the events and keeps the state (GPUs, CPUs,
memory, quota usage, the jobs' states and the current cycle), and checks what a placement
alone shows (`over_allocation`, `gang`, `topology`, `lifecycle`). The quota, duration,
preemption, inversion and rejection rules are in `audit_rules.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduling.cluster import CLUSTER, GPU_GROUP, NODE, Cluster
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.resources import GPU_UNIT, ZERO, Resources
from scheduling.simulator.audit_deficit import DeficitBound, Instant, Victim
from scheduling.simulator.audit_models import ModelQuotaChecks
from scheduling.simulator.audit_rules import RuleChecks, gang_gpus
from scheduling.simulator.sim import to_job
from scheduling.simulator.trace import TraceJob

__all__ = ["Violation", "audit", "audit_or_raise", "true_level"]

Rep = tuple[int, tuple[int, ...], int]  # node index, GPU indices, share in milli-GPUs (0: whole)
_RELEASES, _TAKES = ("evict", "preempt"), ("hold", "admit")
_CYCLE = _RELEASES + _TAKES
# The state each event needs its job in; "" for admit and hold, which place() checks.
_WANT = {"reject": "pending", "evict": "held", "finish": "running", "preempt": "running"}
_WANT.update(demote="running", promote="pending")
_WANT.update(hold="", admit="")


@dataclass(frozen=True, slots=True)
class Violation:
    t: float
    job: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"t={self.t:g} job {self.job}: [{self.rule}] {self.message}"


def audit(
    events: Iterable[dict[str, Any]],
    cluster: Cluster,
    teams: Mapping[str, Team],
    policy: Policy,
    jobs: Mapping[str, TraceJob],
    *,
    checkpoint_s: float | None = None,
) -> list[Violation]:
    """Every broken invariant of the log, in log order; empty when the log is sound.

    With `checkpoint_s` (as given to `simulate`), a run may be shorter than duration x slowdown.
    """
    a = _Auditor(cluster, teams, policy, jobs, checkpoint_s)
    for ev in events:
        a.event(ev)
    a.close_cycle()
    a.end_instant()  # a wait still due after the last event is for `liveness` to report
    for job_id, state in a.state.items():
        if state not in ("rejected", "finished"):
            a.flag(job_id, "liveness", f"still {state} at the end of the log")
    return a.out


def audit_or_raise(
    events: Iterable[dict[str, Any]],
    cluster: Cluster,
    teams: Mapping[str, Team],
    policy: Policy,
    jobs: Mapping[str, TraceJob],
    *,
    checkpoint_s: float | None = None,
) -> None:
    """Raise AssertionError listing the violations (the first 50) if there is any."""
    found = audit(events, cluster, teams, policy, jobs, checkpoint_s=checkpoint_s)
    if found:
        shown = "\n  ".join(str(v) for v in found[:50])
        more = f"\n  ... and {len(found) - 50} more" if len(found) > 50 else ""
        raise AssertionError(f"{len(found)} violation(s), policy {policy.name}:\n  {shown}{more}")


def true_level(cluster: Cluster, reps: Iterable[Rep]) -> str:
    """The smallest topology level whose one domain holds every replica."""
    reps = list(reps)
    nodes = {n for n, _, _ in reps}
    if len(nodes) == 1:
        node = cluster.nodes[next(iter(nodes))]
        mask = sum({1 << g for _, gpus, _ in reps for g in gpus})
        if len(reps) > 1 and mask & ~node.all_gpus:
            return NODE  # MIG instances talk through the host, as `capacity.gang_level` says
        return GPU_GROUP if any(mask & m == mask for m in node.groups) else NODE
    for level in reversed(cluster.levels):  # innermost first
        if len({cluster.domain_of[level][n] for n in nodes}) == 1:
            return level
    return CLUSTER


class _Auditor(RuleChecks, DeficitBound, ModelQuotaChecks):
    def __init__(
        self,
        cluster: Cluster,
        teams: Mapping[str, Team],
        policy: Policy,
        jobs: Mapping[str, TraceJob],
        checkpoint_s: float | None,
    ) -> None:
        self.cluster, self.teams, self.policy, self.jobs = cluster, teams, policy, jobs
        self.checkpoint_s = checkpoint_s
        self.out: list[Violation] = []
        self.t = -math.inf
        self.whole: dict[tuple[int, int], list[str]] = {}  # GPU -> jobs holding it whole
        self.shares: dict[tuple[int, int], dict[str, int]] = {}  # GPU -> job -> milli-GPUs
        self.cpu = [0] * len(cluster.nodes)
        self.mem = [0] * len(cluster.nodes)
        self.alloc: dict[str, list[Rep]] = {}  # job -> the replicas it holds
        # MIG: instance (node, index in Node.mig) -> the job holding it; job -> its instances.
        self.instance_holder: dict[tuple[int, int], str] = {}
        self.instances: dict[str, list[tuple[int, int]]] = {}
        self.state: dict[str, str] = {}  # job -> pending|running|held|rejected|finished
        # job -> (last admit t, slowdown, restart seconds it pays first, speed of its GPU model)
        self.started: dict[str, tuple[float, float, float, float]] = {}
        self.preemptions: dict[str, int] = {}  # job -> times preempted
        # Least attained service: jobs demoted, and GPU-seconds of their ended runs.
        self.demoted: set[str] = set()
        self.promoted: set[str] = set()
        self.attained: dict[str, float] = {}
        self.since: dict[str, float] = {}  # job -> when its current wait began
        self.usage: dict[str, Resources] = dict.fromkeys(teams, ZERO)
        self.ceiling = {n: t.nominal + t.borrowing_limit for n, t in teams.items()}
        self.guaranteed = {n: (t.nominal - t.lending_limit).clamp_low() for n, t in teams.items()}
        self.pool = sum((t.lending_limit for t in teams.values()), ZERO)
        self.tree = any(t.cohorts for t in teams.values())  # an organization tree
        self.init_models(policy.quotas and not policy.gangs.holds_partial)
        # The current cycle: team GPU usage before it, and its releases and takes in log order.
        self.base: dict[str, int] | None = None
        self.cycle: list[tuple[str, TraceJob, str, int]] = []  # (type, job, by, GPU delta)
        self.taking = False
        # The nominal-deficit rule: pending jobs (-> when their wait began), how many of each
        # class (Job.shape) wait, the current instant's decisions, and per job the time by
        # which the engine had to act for it (and the victim it had), if nothing happens first.
        self.bound = policy.reclaim_bound_s
        # Infinite for a policy that promises no bound (no quotas or preemption, partial
        # gangs, strict head of line, a bounded reclaim search or an infinite deadline).
        self.watch = math.isfinite(self.bound)
        self.waiting: dict[str, float] = {}
        self.shapes: dict[str, tuple[Resources, Resources, tuple]] = {}  # job -> `shape()`
        self.classes: dict[tuple, int] = {}
        self.instant = Instant()
        self.due: dict[str, tuple[float, Victim]] = {}
        self.deficits: set[tuple[str, float]] = set()  # (job, wait began) flagged already

    def flag(self, job: str, rule: str, message: str) -> None:
        self.flag_at(self.t, job, rule, message)

    def flag_at(self, t: float, job: str, rule: str, message: str) -> None:
        self.out.append(Violation(t, job, rule, message))

    def event(self, ev: Mapping[str, Any]) -> None:
        t, kind, job_id = float(ev["t"]), str(ev["type"]), str(ev["job"])
        if t < self.t:
            self.flag(job_id, "lifecycle", f"time goes back from {self.t:g} to {t:g}")
        elif t > self.t and self.watch:
            self.end_instant()
            self.check_due(t)
        # A cycle's events come as releases (evict, preempt), then takes (hold, admit).
        if t != self.t or kind not in _CYCLE or (self.taking and kind in _RELEASES):
            self.close_cycle()
        self.t = t
        state, job = self.state.get(job_id), self.jobs.get(job_id)
        if kind == "submit":
            if state is not None:
                self.flag(job_id, "lifecycle", "submitted twice")
            self.state[job_id] = "pending"
            self.since[job_id] = t
            if job is not None and self.watch:
                if not self.classes.get(self.shape(job)[2]):
                    self.instant.fresh.append(job_id)  # the engine ran a cycle for it
                self.enqueue(job, t)
            return
        if state is None or job is None:
            self.flag(job_id, "lifecycle", f"{kind} of a job never submitted or not in the trace")
            return
        if kind not in _WANT:
            self.flag(job_id, "lifecycle", f"unknown event type {kind!r}")
            return
        if _WANT[kind] and state != _WANT[kind]:
            self.flag(job_id, "lifecycle", f"{kind} while {state}")
            return
        if kind == "demote":
            self.check_demotion(job)
            return
        if kind == "promote":
            self.check_promotion(job)
            return
        if kind == "reject":
            self.state[job_id] = "rejected"
            self.check_rejection(job)
            self.dequeue(job)
            return
        if kind in _CYCLE and self.base is None:
            self.base = {team: u.gpu for team, u in self.usage.items()}
            self.model_base = dict(self.model_usage)
        held = self.alloc.get(job_id, [])  # what a release gives back
        self.instant.cycle = True  # a finish, or a decision: the engine ran a cycle
        if kind in _TAKES:
            delta = self.place(ev, job, state)
            if self.watch:
                self.note_take(job, kind, state)
        else:
            if kind == "finish":
                self.check_duration(job, bool(ev.get("timed_out")))
            elif kind == "preempt":
                self.check_preemption(job, str(ev.get("by")))
                self.since[job_id] = t
            if kind != "finish" and self.watch:
                self.note_release(job, kind)
            self.release(job, quota=True)
            self.state[job_id] = "finished" if kind == "finish" else "pending"
            if kind != "finish" and self.watch:
                self.enqueue(job, t)
            delta = -gang_gpus(job)
        if kind in _CYCLE:
            self.cycle.append((kind, job, str(ev.get("by")), delta))
            reps = self.alloc.get(job_id, []) if kind in _TAKES else held
            self.cycle_models[kind, job_id] = self.models_of(reps, job)
            self.taking = kind in _TAKES

    # -- least attained service --------------------------------------------------------------

    def rank(self, job: TraceJob) -> int:
        """`Job.rank` as the engine compares it: twice the priority, plus one unless demoted."""
        return 2 * job.priority + (0 if job.job_id in self.demoted else 1)

    def service_gpus(self, job: TraceJob) -> float:
        """The GPUs a run of `job` counts per second of service, as the engine counts them (a
        MIG instance: its compute share)."""
        return to_job(job).demand.gpu / GPU_UNIT if job.mig_profile else gang_gpus(job) / GPU_UNIT

    def saves_every(self, job: TraceJob) -> float:
        """The job's checkpoint interval in the engine (inf: it never saves)."""
        every = job.checkpoint_s if job.checkpoint_s is not None else self.checkpoint_s
        return math.inf if every is None else every

    def check_demotion(self, job: TraceJob) -> None:
        """A demotion (`EngineState.demote_due`): only under least attained service, of a
        running preemptible job that checkpoints, once, and not before its service over all
        its runs reached the policy's threshold."""
        jid, pol = job.job_id, self.policy
        ran = self.t - self.started[jid][0]
        gpus = self.service_gpus(job)
        attained = self.attained.get(jid, 0.0) + gpus * ran
        limit = pol.las_limit_gpu_s(gpus)
        why = {
            f"policy {pol.name} has no least attained service": not pol.las,
            "the job does not checkpoint": self.saves_every(job) == math.inf,
            "the job is not preemptible": not job.preemptible,
            "demoted twice": jid in self.demoted,
            "demoted again after its promotion": jid in self.promoted,
            f"demoted after {attained:g} GPU-seconds < its threshold of {limit:g}": attained
            < limit * (1 - 1e-9) - 1e-6,
        }
        for message, broken in why.items():
            if broken:
                self.flag(jid, "demotion", message)
        self.demoted.add(jid)
        self.shapes.pop(jid, None)  # its class in the engine's queue changes with its rank

    def check_promotion(self, job: TraceJob) -> None:
        """A promotion (`EngineState.promote_due`): only of a demoted job waiting, under a
        policy that promotes, once it has waited since its preemption the policy's multiple
        of its run time so far."""
        jid, pol = job.job_id, self.policy
        gpus = self.service_gpus(job)
        due = pol.las_promote_wait_s(gpus, self.attained.get(jid, 0.0))
        waited = self.t - self.since[jid]
        why = {
            f"policy {pol.name} does not promote": pol.las_promote_after_x == math.inf,
            "the job is not demoted": jid not in self.demoted,
            f"promoted after waiting {waited:g} s < {due:g} s": math.isfinite(due)
            and waited < due * (1 - 1e-9) - 1e-6,
        }
        for message, broken in why.items():
            if broken:
                self.flag(jid, "demotion", message)
        self.demoted.discard(jid)
        self.promoted.add(jid)
        self.shapes.pop(jid, None)  # its class in the engine's queue changes with its rank

    # -- admit, hold, release ----------------------------------------------------------------

    def place(self, ev: Mapping[str, Any], job: TraceJob, state: str) -> int:
        """Apply an admit or hold; returns what it adds to the team's GPU usage."""
        jid, kind = job.job_id, ev["type"]
        if state not in ("pending", "held") or (
            kind == "hold" and not self.policy.gangs.holds_partial
        ):
            self.flag(jid, "lifecycle", f"{kind} while {state} under policy {self.policy.name}")
            if state == "running":
                return 0
        reps, instances = self.parse(job, ev.get("placement") or [], kind)
        delta = 0
        if state == "held":
            self.release(job, quota=False)  # a held gang already holds its whole quota
        else:
            self.charge(job, 1)
            delta = gang_gpus(job)
        for rep in reps:
            self.take(job, rep)
        for key in instances:  # after a held gang's release: its instances are its own again
            if key in self.instance_holder:
                node = self.cluster.nodes[key[0]].name
                other = self.instance_holder[key]
                self.flag(jid, "over_allocation", f"{node} MIG instance {key[1]} held by {other}")
            self.instance_holder[key] = jid
        if instances:
            self.instances[jid] = instances
        self.alloc[jid] = reps
        self.state[jid] = "held" if kind == "hold" else "running"
        if kind == "hold":
            return delta
        self.charge_models(job, reps, 1)
        level, slowdown = str(ev.get("level")), float(ev.get("slowdown", math.nan))
        # The gang's speed: its slowest GPU model's (worked out here from the cluster).
        speed = min(self.cluster.gpu_speed.get(self.cluster.nodes[n].gpu_model, 1.0)
                    for n, _, _ in reps) if reps else 1.0  # fmt: skip
        self.started[jid] = (self.t, slowdown, float(ev.get("restart_s") or 0.0), speed)
        if not math.isclose(slowdown, self.cluster.slowdown_of(level), rel_tol=1e-9):
            self.flag(jid, "duration", f"slowdown {slowdown:g} is not that of level {level}")
        if len(reps) == job.replicas:
            true, rank = true_level(self.cluster, reps), self.cluster.rank
            if level != true:
                self.flag(jid, "topology", f"level {level} but the placement spans a {true}")
            limit = CLUSTER if job.topology == "any" else job.topology
            if limit == GPU_GROUP and self.policy.placement.finest == NODE:
                limit = NODE  # Kueue cannot ask for a GPU group: the best it can ask is a node
            if limit not in rank or rank[true] > rank[limit]:
                self.flag(jid, "topology", f"spans a {true}; the job requires {job.topology}")
        self.check_models(job, reps)
        return delta

    def check_models(self, job: TraceJob, reps: list[Rep]) -> None:
        """Every replica on a GPU model the job accepts, and on one model unless mixed."""
        models = sorted({self.cluster.nodes[node].gpu_model for node, _, _ in reps})
        accepted = job.gpu_models
        wrong = [m for m in models if accepted and m not in accepted]
        if wrong:
            self.flag(job.job_id, "gpu_model", f"placed on {', '.join(wrong)}; it accepts "
                      f"{', '.join(accepted)}")  # fmt: skip
        if len(models) > 1 and not job.mixed_models:
            self.flag(job.job_id, "gpu_model", f"one gang on {', '.join(models)}; it did not "
                      "ask for mixed models")  # fmt: skip

    def parse(
        self, job: TraceJob, entries: list[dict[str, Any]], kind: str
    ) -> tuple[list[Rep], list[tuple[int, int]]]:
        """The placement's well-formed replicas, and a MIG job's instances (node, index in
        `Node.mig`); flags a gang that is not whole."""
        jid, milli = job.job_id, round(job.gpus_per_replica * GPU_UNIT)
        mig = job.mig_profile
        whole = milli // GPU_UNIT if milli >= GPU_UNIT and not mig else 0
        instances: list[tuple[int, int]] = []
        n = len(entries)
        if (n != job.replicas) if kind == "admit" else (n > job.replicas):  # a hold: some
            self.flag(jid, "gang", f"{kind} of {n} replica(s); the job has {job.replicas}")
        reps: list[Rep] = []
        for i, e in enumerate(entries):
            node = self.cluster.by_name.get(str(e.get("node")))
            gpus = tuple(int(g) for g in e.get("gpus", ()))
            share = round(float(e.get("share") or 0) * GPU_UNIT)
            if node is None:
                problem = f"no node {e.get('node')!r}"
            elif any(not 0 <= g < node.gpus for g in gpus) or len(set(gpus)) != len(gpus):
                problem = f"GPUs {list(gpus)} are not distinct GPUs of node {node.name}"
            elif mig:
                k = e.get("instance")
                held = node.mig[k] if isinstance(k, int) and 0 <= k < len(node.mig) else None
                if held is None or (tuple(gpus), share) != ((held[0],), milli) or held[1] != mig:
                    problem = f"instance {k} on GPUs {list(gpus)} is not a {mig} of {node.name}"
                else:
                    reps.append((node.index, gpus, share))
                    instances.append((node.index, k))
                    continue
            elif any(not node.all_gpus >> g & 1 for g in gpus):
                problem = f"GPUs {list(gpus)} of node {node.name} include a MIG-partitioned one"
            elif (len(gpus), share) != ((whole, 0) if whole else (1, milli)):
                problem = f"{len(gpus)} GPU(s) at share {share}m; the job asks {milli}m"
            else:
                reps.append((node.index, gpus, share))
                continue
            self.flag(jid, "gang", f"replica {i}: {problem}")
        return reps, instances

    def take(self, job: TraceJob, rep: Rep) -> None:
        (i, gpus, share), jid = rep, job.job_id
        node = self.cluster.nodes[i]
        for g in () if job.mig_profile else gpus:  # MIG instances: counted in `place`
            key = (i, g)
            holders, shared = self.whole.get(key, []), self.shares.get(key, {})
            if share:
                shared[jid] = shared.get(jid, 0) + share
                self.shares[key] = shared
                total = sum(shared.values())
                if holders or total > GPU_UNIT:
                    what = f"held whole by {holders}" if holders else f"shared {total}m"
                    self.flag(jid, "over_allocation", f"{node.name} GPU {g} {what}")
            else:
                if holders or shared:
                    who = holders + sorted(shared)
                    self.flag(jid, "over_allocation", f"{node.name} GPU {g} held by {who}")
                self.whole.setdefault(key, []).append(jid)
        r = Resources.of(0, job.cpus_per_replica, job.memory_gb_per_replica)
        self.cpu[i] += r.cpu
        self.mem[i] += r.mem
        if self.cpu[i] > node.cpu or self.mem[i] > node.mem:
            use = f"{self.cpu[i]}/{node.cpu} milli-CPUs, {self.mem[i]}/{node.mem} MiB"
            self.flag(jid, "over_allocation", f"{node.name} uses {use}")

    def release(self, job: TraceJob, *, quota: bool) -> None:
        jid = job.job_id
        if self.state.get(jid) == "running":
            self.charge_models(job, self.alloc.get(jid, ()), -1)
        r = Resources.of(0, job.cpus_per_replica, job.memory_gb_per_replica)
        for key in self.instances.pop(jid, ()):
            if self.instance_holder.get(key) == jid:
                del self.instance_holder[key]
        for i, gpus, share in self.alloc.pop(jid, []):
            for g in () if job.mig_profile else gpus:
                if not share:
                    self.whole[(i, g)].remove(jid)
                    continue
                shared = self.shares[(i, g)]
                shared[jid] -= share
                if shared[jid] <= 0:
                    del shared[jid]
                if not shared:
                    del self.shares[(i, g)]
            self.cpu[i] -= r.cpu
            self.mem[i] -= r.mem
        if quota:
            self.charge(job, -1)
