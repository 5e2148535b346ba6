"""The audit's rule checks on what the replay applies: quota (`charge`), the run's duration,
a preemption's guards and the cycle's order (`close_cycle`: a victim's team left below its
nominal, a reclaim above the preemptor's own nominal, an inversion), and whether a rejection
was right.

A mixin of the audit's replay (`audit._Auditor`), which owns the state the rules read (usage,
the jobs' states, admit times and waits, the current cycle) and calls them as it walks the log;
apart so that the replay reads as the walk over events and each rule can be read alone.
"""

from __future__ import annotations

import math
from typing import Any

from scheduling.cluster import CLUSTER, GPU_GROUP, NODE, Cluster
from scheduling.cohorts import below_common, cohort_usage, reachable, tree_excess
from scheduling.jobs import rank_words
from scheduling.resources import GPU_UNIT, ZERO, Resources, gpu_request_problem
from scheduling.simulator.trace import TraceJob

__all__ = ["RuleChecks", "gang_gpus"]


class RuleChecks:
    """The rules' methods; `audit._Auditor` inherits them and calls `charge` when a job
    takes or gives back its quota, `check_duration` on a finish, `check_preemption` on a
    preempt, `close_cycle` when a cycle's events end and `check_rejection` on a reject."""

    def charge(self, job: TraceJob, sign: int) -> None:
        """Add (sign 1) or take back (-1) the whole gang's request from its team's usage."""
        team = job.team
        if team not in self.usage:
            self.flag(job.job_id, "quota", f"team {team!r} is not a known team")
            return
        r = Resources.of(job.gpus_per_replica, job.cpus_per_replica, job.memory_gb_per_replica)
        self.usage[team] = self.usage[team] + r * (sign * job.replicas)
        if sign < 0 or not self.policy.quotas:
            return
        if not job.preemptible:
            used = self.usage[team]
            if self.policy.gangs.holds_partial:
                # A cycle logs its holds before its admissions, whatever order it decided
                # them in: leave out the quota of gangs held now (rare: a scan is fine).
                for jid, st in self.state.items():
                    held = self.jobs.get(jid)
                    if (
                        st == "held"
                        and held is not None
                        and held.team == team
                        and jid != job.job_id
                    ):
                        used = (
                            used
                            - Resources.of(
                                held.gpus_per_replica,
                                held.cpus_per_replica,
                                held.memory_gb_per_replica,
                            )
                            * held.replicas
                        )
            over = used.first_excess(self.teams[team].nominal)
            if over:
                self.flag(
                    job.job_id,
                    "quota",
                    f"non-preemptible, and team {team} is above its nominal {over}",
                )
        over = self.usage[team].first_excess(self.ceiling[team])
        if over:
            self.flag(job.job_id, "quota", f"team {team} is above nominal + borrowing in {over}")
        broken = tree_excess(self.teams, self.usage)
        if broken is not None:
            cohort, over = broken
            if cohort:
                self.flag(
                    job.job_id,
                    "quota",
                    f"cohort {cohort} uses more {over} than its quota + borrowing_limit",
                )
            else:
                self.flag(job.job_id, "quota", f"the cohort lends more {over} than its teams lend")

    def check_duration(self, job: TraceJob, timed_out: bool = False) -> None:
        start, slowdown, restart, speed = self.started.pop(job.job_id)
        ran, want = self.t - start, (job.duration / speed + restart) * slowdown
        limit = math.inf if job.time_limit_s is None else job.time_limit_s
        # The runtime stops a run exactly at its time limit, and only one that needed more
        # (with checkpoints, what it needed is less than `want`: unknown here).
        saves = job.checkpoint_s is not None or bool(self.checkpoint_s)  # its own, or all's
        needed_more = want > limit or saves
        if timed_out and not (needed_more and math.isclose(ran, limit, abs_tol=1e-6)):
            self.flag(
                job.job_id, "duration", f"stopped after {ran:g}s at a time limit of {limit:g}s"
            )
        if timed_out:
            return
        if ran > limit + 1e-6 or (want > limit and not saves):
            self.flag(
                job.job_id,
                "duration",
                f"ran {ran:g}s (wanted {want:g}s) with a time limit of {limit:g}s; it should "
                "have been stopped (timed_out) at its limit",
            )
            return
        if math.isclose(ran, want, rel_tol=1e-9, abs_tol=1e-6):
            return
        if saves and 0 < ran < want:
            return  # resumed from a checkpoint
        self.flag(job.job_id, "duration", f"ran {ran:g}s since its last admit; want {want:g}s")

    def check_preemption(self, victim: TraceJob, by: str) -> None:
        """The rules about the victim alone; the quota rule waits for the end of the cycle."""
        vid, pol, pre = victim.job_id, self.policy, self.jobs.get(by)
        ran = self.t - self.started.pop(vid)[0]
        self.attained[vid] = self.attained.get(vid, 0.0) + self.service_gpus(victim) * ran
        self.preemptions[vid] = times = self.preemptions.get(vid, 0) + 1
        # The guards of long work apply to priority preemption always, to reclaim until the
        # lender's job has waited reclaim_deadline_s. Under least attained service, a job that
        # checkpoints is guarded by its unsaved work (`Running.unsaved_s`), not its run time.
        priority = pre is not None and pre.team == victim.team
        waited = self.t - self.since.get(by, self.t)
        guarded = priority or waited < pol.reclaim_deadline_s - 1e-6
        every = self.saves_every(victim)
        by_saves = pol.las and every != math.inf
        unsaved = ran % every if by_saves else ran
        why = {
            f"policy {pol.name} does not preempt": not pol.preemption,
            "the victim is not preemptible": not victim.preemptible,
            f"it ran {ran:g}s < min_runtime_s": ran < pol.min_runtime_s - 1e-6,
            f"{unsaved:g}s of its work would be lost > max_victim_runtime_s": guarded
            and unsaved > pol.max_victim_runtime_s + 1e-6,
            f"preempted {times} times > max_preemptions": guarded and times > pol.max_preemptions,
            f"preemptor {by!r} is not in the trace": pre is None,
            "same team, and the preemptor's rank (priority, then not demoted) is not higher": (
                priority and self.rank(pre) <= self.rank(victim)
            ),
            f"preemptor {by!r} waited {waited:g}s < preemption_delay_s": waited
            < pol.preemption_delay_s - 1e-6,
            f"preemptor {by!r} asks for more than its team's nominal": pre is not None
            and not pol.preempts_beyond_nominal
            and pre.team in self.teams
            and bool(self.shape(pre)[1].first_excess(self.teams[pre.team].nominal)),
        }
        for message, broken in why.items():
            if broken:
                self.flag(vid, "preemption", message)

    def _check_borrowing(self, team: str, victims: list[TraceJob], base: dict[str, int]) -> None:
        """Kueue's rule (`Policy.victim_keeps_nominal` off): each reclaim victim's team is
        borrowing GPUs when the victim is taken. In the best order (the biggest last) a team
        still borrows before its last victim goes when what it held, less all its victims but
        the biggest, is above its nominal."""
        by_team: dict[str, list[int]] = {}
        for v in victims:
            if v.team != team and gang_gpus(v) > 0:
                by_team.setdefault(v.team, []).append(gang_gpus(v))
        for other, taken in by_team.items():
            nominal = self.teams[other].nominal.gpu if other in self.teams else 0
            before_last = base.get(other, 0) - sum(taken) + max(taken)
            if before_last <= nominal:
                held = base.get(other, 0) / GPU_UNIT
                self.flag(
                    next(v.job_id for v in victims if v.team == other),
                    "preemption",
                    f"team {other} (holding {held:g} GPUs) was not borrowing when its last "
                    "victim was taken",
                )

    def _check_subtrees(self, job: TraceJob, others: list[TraceJob], base: dict[str, int]) -> None:
        """The strict hierarchical reclaim (`Policy.tree_reclaim`, `victim_rules.Released`): a
        victim's cohorts below the one its team shares with the preemptor's borrow from their
        parents when the plan starts (its usage only falls as the plan takes victims), and
        under Berth's rule (`victim_keeps_nominal`) keep their quotas once all of the plan's
        victims are gone. ("prefer" may take any borrower when no such plan exists.)"""
        teams = self.teams
        if job.team not in teams:
            return
        before, _ = cohort_usage(teams, _gpus(base))
        after_base = dict(base)
        for v in others:
            after_base[v.team] = after_base.get(v.team, 0) - gang_gpus(v)
        after, _ = cohort_usage(teams, _gpus(after_base))
        keep = self.policy.victim_keeps_nominal
        for v in others:
            if v.team not in teams or gang_gpus(v) <= 0:
                continue
            for c in below_common(teams[v.team], teams[job.team]):
                quota = c.quota.gpu
                used, left = before.get(c.name, ZERO).gpu, after.get(c.name, ZERO).gpu
                if used <= quota:
                    why = f"was not borrowing: it used {used / GPU_UNIT:g}"
                elif keep and left < quota:
                    why = f"was left with {left / GPU_UNIT:g}"
                else:
                    continue
                self.flag(
                    v.job_id,
                    "preemption",
                    f"reclaimed by {job.job_id} of team {job.team}, but its cohort {c.name} "
                    f"{why} GPUs of its quota of {quota / GPU_UNIT:g}",
                )
                break

    def close_cycle(self) -> None:
        """Replay the cycle in decision order, each preemptor's victims just before it: a
        victim of another team must not leave its team below nominal GPUs. (The log lists a
        cycle's preemptions before its admissions, hiding the order the engine decided in.)"""
        base, cycle = self.base, self.cycle
        self.base, self.cycle, self.taking = None, [], False
        models, self.model_base = dict(self.model_base), {}
        if base is None:
            self.cycle_models = {}
            return
        victims: dict[str, list[TraceJob]] = {}
        for kind, job, by, delta in cycle:
            if kind == "preempt":
                victims.setdefault(by, []).append(job)
            elif kind == "evict" and job.team in base:
                base[job.team] += delta
        lowest: dict[str, int] = {}  # per team, the lowest rank admitted in this cycle
        for kind, job, _, delta in cycle:
            if kind != "admit":
                continue
            mine = victims.pop(job.job_id, [])
            others = [v for v in mine if v.team != job.team]
            # A reclaim of one GPU model answers to the model's nominals, not the totals'.
            own = self.teams[job.team].nominal.gpu if job.team in self.teams else 0
            by_model = (
                bool(others)
                and base.get(job.team, 0) + delta <= own  # within its total nominal too
                and self.model_reclaim(job, others, models)
            )
            if not self.policy.victim_keeps_nominal and not by_model:
                self._check_borrowing(job.team, mine, base)
            strict = self.policy.tree_reclaim == "strict"
            if strict and others and not by_model and any(t.cohorts for t in self.teams.values()):
                self._check_subtrees(job, others, base)
            for v in mine:
                base[v.team] = base.get(v.team, 0) - gang_gpus(v)
                for model, gpu in self.cycle_models.get(("preempt", v.job_id), {}).items():
                    models[v.team, model] = models.get((v.team, model), 0) - gpu
            for v in mine:
                nominal = self.teams[v.team].nominal.gpu if v.team in self.teams else 0
                keeps = self.policy.victim_keeps_nominal
                if keeps and v.team != job.team and base[v.team] < nominal and not by_model:
                    left = base[v.team] / GPU_UNIT
                    self.flag(v.job_id, "preemption", f"team {v.team} left with {left:g} GPUs")
            base[job.team] = base.get(job.team, 0) + delta
            for model, gpu in self.cycle_models.get(("admit", job.job_id), {}).items():
                models[job.team, model] = models.get((job.team, model), 0) + gpu
            if others and base[job.team] > own and not by_model:
                held = base[job.team] / GPU_UNIT
                self.flag(
                    job.job_id,
                    "preemption",
                    f"reclaimed, but team {job.team} then holds {held:g} GPUs, above its nominal",
                )
            rank = self.rank(job)
            lowest[job.team] = min(lowest.get(job.team, rank), rank)
        for kind, job, _, _ in cycle:
            rank = self.rank(job)
            if kind == "preempt" and rank > lowest.get(job.team, rank):
                self.flag(
                    job.job_id,
                    "inversion",
                    f"preempted ({rank_words(rank)}) in a "
                    f"cycle that admits team {job.team}'s {rank_words(lowest[job.team])}",
                )
        for by, vs in victims.items():
            for v in vs:
                self.flag(v.job_id, "preemption", f"preemptor {by} was not admitted with it")
        self.cycle_models = {}

    def check_rejection(self, job: TraceJob) -> None:
        """A rejection must be right: the job fits no domain of its level on the empty cluster,
        or asks more than its team can ever hold, or is malformed. Worked out here from the
        cluster and the quotas alone, not with the engine's own admission code."""
        if job.team not in self.teams or gpu_request_problem(job.gpus_per_replica):
            return
        if job.topology != "any" and job.topology not in self.cluster.rank:
            return
        if any(m not in {n.gpu_model for n in self.cluster.nodes} for m in job.gpu_models):
            return  # a GPU model the cluster does not have
        if job.mig_profile and job.topology == GPU_GROUP:
            return  # MIG instances share no NVLink: no gang of them keeps to a GPU group
        demand = (
            Resources.of(job.gpus_per_replica, job.cpus_per_replica, job.memory_gb_per_replica)
            * job.replicas
        )
        if self.policy.quotas:
            team = self.teams[job.team]
            reach = reachable(team, self.teams)  # within its ceiling and its cohorts' limits
            if not job.preemptible:
                n = team.nominal
                reach = Resources(
                    min(reach.gpu, n.gpu), min(reach.cpu, n.cpu), min(reach.mem, n.mem)
                )
            if demand.first_excess(reach):
                return
        accepted = job.gpu_models or tuple({n.gpu_model: 0 for n in self.cluster.nodes})
        quotas = self.model_quotas.get(job.team)
        if self.policy.quotas and quotas:
            # Per-model keys: a gang runs on one model (all of it counts there), within the
            # team's ceiling of that model and its guaranteed part plus the model's pool.
            reach_of = {
                m: min(
                    q.ceiling if job.preemptible else q.nominal, q.guaranteed + self.model_pool[m]
                )
                for m, q in quotas.items()
            }
            accepted = tuple(m for m in accepted if m not in reach_of or reach_of[m] >= demand.gpu)
            if not accepted:
                return
            # A MIG job's instances count in its profile's key (1000 each), if governed.
            profile_key = f"mig.{job.mig_profile}" if job.mig_profile else None
            if profile_key in reach_of and reach_of[profile_key] < GPU_UNIT * job.replicas:
                return
        if not _fits_when_empty(self.cluster, job, accepted):
            return
        self.flag(
            job.job_id,
            "rejection",
            "rejected, but it fits the empty cluster within its team's reach",
        )


def _fits_when_empty(cluster: Cluster, job: TraceJob, accepted: tuple[str, ...]) -> bool:
    """Could the whole gang be placed on the empty cluster within its topology requirement,
    on the GPU models `accepted`?"""
    r = Resources.of(job.gpus_per_replica, job.cpus_per_replica, job.memory_gb_per_replica)
    per_gpu = 1 if r.gpu >= GPU_UNIT else GPU_UNIT // r.gpu  # replicas one GPU can take
    g = max(r.gpu // GPU_UNIT, 1)
    mig = job.mig_profile

    def slots(mask: int, node: Any) -> int:
        """Replicas `node` takes on the whole GPUs of `mask` (a MIG job: on its instances)."""
        if mig:
            s = sum(p == mig for _, p in node.mig)
        else:
            s = (mask & node.all_gpus).bit_count() // g * (1 if r.gpu >= GPU_UNIT else per_gpu)
        if r.cpu:
            s = min(s, node.cpu // r.cpu)
        if r.mem:
            s = min(s, node.mem // r.mem)
        return s

    level = CLUSTER if job.topology == "any" else job.topology
    if job.replicas == 1 and cluster.rank[level] > cluster.rank[NODE]:
        level = NODE
    # The nodes of one GPU model the job accepts at a time; all it accepts when mixed.
    if job.mixed_models:
        model_sets = [{n.index for n in cluster.nodes if n.gpu_model in accepted}]
    else:
        model_sets = [{n.index for n in cluster.nodes if n.gpu_model == m} for m in accepted]
    for ok in model_sets:
        if level == GPU_GROUP:
            groups = [(m, n) for n in cluster.nodes if n.index in ok for m in n.groups]
            fits = any(slots(m, n) >= job.replicas for m, n in groups)
        elif level == NODE:
            fits = any(slots(-1, n) >= job.replicas for n in cluster.nodes if n.index in ok)
        else:
            fits = any(
                sum(slots(-1, cluster.nodes[i]) for i in nodes if i in ok) >= job.replicas
                for nodes in cluster.domains[level].values()
            )
        if fits:
            return True
    return False


def _gpus(milli: dict[str, int]) -> dict[str, Resources]:
    return {team: Resources(gpu) for team, gpu in milli.items()}


def gang_gpus(job: TraceJob) -> int:
    """The whole gang's GPUs, in milli-GPUs."""
    return round(job.gpus_per_replica * GPU_UNIT) * job.replicas
