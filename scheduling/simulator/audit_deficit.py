"""The audit's nominal-deficit bound: a lender's job is not left waiting past
`Policy.reclaim_bound_s` while a borrowed job could make room for it.

A mixin of the audit's replay (`audit._Auditor`), which owns the state it reads (usage, the
per-GPU and per-node allocation, the jobs' states and waits); apart because the rule is long
and stands on its own. The rule, why it is sound, and what it tolerates: `end_instant`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from scheduling.cluster import GPU_GROUP
from scheduling.cohorts import below_common, cohort_usage, tree_excess
from scheduling.resources import GPU_UNIT, ZERO, Resources
from scheduling.simulator.trace import TraceJob

__all__ = ["DeficitBound", "Instant", "Victim"]


@dataclass(slots=True)
class Instant:
    """One instant's decisions, as the nominal-deficit rule needs them: the engine examined a
    pending job somewhere between the instant's first decision and its last, so the state it
    saw lies between the state at the end less what the instant took, and the state at the
    end plus what it gave back."""

    cycle: bool = False  # a cycle surely ran: a finish or a decision was logged
    fresh: list[str] = field(default_factory=list)  # submitted with no pending job of its class
    moved: set[str] = field(default_factory=set)  # jobs admitted, held, preempted or evicted
    taken: dict[str, Resources] = field(default_factory=dict)  # per team, quota taken
    given: dict[str, Resources] = field(default_factory=dict)  # per team, quota given back
    lost: dict[str, int] = field(default_factory=dict)  # per team, top priority preempted
    floor: dict[str, int] = field(default_factory=dict)  # per team, lowest priority admitted
    touched: set[tuple[int, int]] = field(default_factory=set)  # GPUs taken or given back
    cpu: dict[int, int] = field(default_factory=dict)  # per node, CPUs given back
    mem: dict[int, int] = field(default_factory=dict)  # per node, memory given back
    models: dict[tuple[str, str], int] = field(default_factory=dict)  # (team, model) given back
    models_taken: dict[tuple[str, str], int] = field(default_factory=dict)  # ... and taken


@dataclass(frozen=True, slots=True)
class Victim:
    """A running job the engine may take from its borrowing team for any lender, and the room
    each of its nodes would have without it (GPUs in milli, CPUs, memory)."""

    job: TraceJob
    start: float
    demand: Resources
    rooms: tuple[tuple[int, int, int, int], ...]  # (node, GPUs, CPUs, memory)
    total: bool  # its team borrows GPUs in total and may lose it (preemption.py's reclaim)
    model: str | None  # the governed model its team borrows and it runs on (model_reclaim.py)
    by_model: Mapping[str, int]  # its GPUs (milli) per model


class DeficitBound:
    """The rule's methods; `audit._Auditor` inherits them and calls `enqueue`, `dequeue`,
    `note_take`, `note_release`, `end_instant` and `check_due` as it replays the log."""

    def shape(self, job: TraceJob) -> tuple[Resources, Resources, tuple]:
        """(per replica, whole gang, the job's class: its team and `Job.shape`)."""
        got = self.shapes.get(job.job_id)
        if got is None:
            r = Resources.of(job.gpus_per_replica, job.cpus_per_replica, job.memory_gb_per_replica)
            limit = math.inf if job.time_limit_s is None else job.time_limit_s
            key = (
                job.team, self.rank(job), job.replicas, r, job.topology, job.preemptible, limit,
                job.gpu_model, job.mixed_models,
            )  # fmt: skip
            got = self.shapes[job.job_id] = (r, r * job.replicas, key)
        return got

    def enqueue(self, job: TraceJob, since: float) -> None:
        self.waiting[job.job_id] = since
        key = self.shape(job)[2]
        self.classes[key] = self.classes.get(key, 0) + 1

    def dequeue(self, job: TraceJob) -> None:
        if self.waiting.pop(job.job_id, None) is not None:
            self.classes[self.shape(job)[2]] -= 1

    def note_take(self, job: TraceJob, kind: str, state: str) -> None:
        rec, jid = self.instant, job.job_id
        rec.moved.add(jid)
        rec.touched.update((i, g) for i, gpus, _ in self.alloc.get(jid, ()) for g in gpus)
        if state == "pending":
            rec.taken[job.team] = rec.taken.get(job.team, ZERO) + self.shape(job)[1]
            for model, gpu in self.models_of(self.alloc.get(jid, ()), job).items():
                key = (job.team, model)
                rec.models_taken[key] = rec.models_taken.get(key, 0) + gpu
        if kind == "admit":
            rank = self.rank(job)
            rec.floor[job.team] = min(rec.floor.get(job.team, rank), rank)
        self.dequeue(job)

    def note_release(self, job: TraceJob, kind: str) -> None:
        """Before a preemption or eviction releases `job`."""
        rec, jid, (r, d, _) = self.instant, job.job_id, self.shape(job)
        rec.moved.add(jid)
        for i, gpus, _ in self.alloc.get(jid, ()):
            rec.touched.update((i, g) for g in gpus)
            rec.cpu[i] = rec.cpu.get(i, 0) + r.cpu
            rec.mem[i] = rec.mem.get(i, 0) + r.mem
        rec.given[job.team] = rec.given.get(job.team, ZERO) + d
        for model, gpu in self.models_of(self.alloc.get(jid, ()), job).items():
            rec.models[job.team, model] = rec.models.get((job.team, model), 0) + gpu
        if kind == "preempt":
            rank = self.rank(job)
            rec.lost[job.team] = max(rec.lost.get(job.team, rank), rank)

    def end_instant(self) -> None:
        """The nominal-deficit bound (`Policy.reclaim_bound_s`), at the end of an instant in
        which the engine surely ran a cycle: a finish or a decision was logged, or a job was
        submitted while no job of its class (`Job.shape`) was pending (the engine settles a
        new job without a cycle only when one of its class failed in the last cycle).

        Each job J still pending that was pending before the instant's decisions was examined
        in that cycle. The rule looks only at a J whose reclaim needs nothing but one victim
        on one node: one replica of whole GPUs, no topology narrower than a node. J is owed a
        victim V, a preemptible whole-GPU job of another team U running since before the
        instant, when all of this holds wherever in the instant the engine examined J, that is
        for every state between the end less the instant's takes and the end plus what it
        gave back (lower bounds on room, upper bounds on usage):
        - J's team T: usage + J within its nominal in GPUs, CPUs and memory (J reclaims);
        - U keeps its nominal without V: in GPUs always, in CPUs and memory where U is above
          them (the engine's rule: a victim's team never ends below its nominal), or, with
          `Policy.victim_keeps_nominal` off (Kueue's rule), U is borrowing GPUs;
        - one of V's nodes holds J without V: its free GPUs (less any GPU a decision of the
          instant touched), CPUs and memory (less what the instant gave back);
        - the cohort's pool still lends T what J draws on it once V is gone;
        - where per-model keys are enforced and the node's model M is governed (some team
          declares a `gpus.<MODEL>` key for it), T's use of M + J is within T's nominal of M
          (else J would borrow M, which is not a reclaim), and M's pool lends T what J draws
          on it once V is gone (the searches' trial ledgers give back V's GPUs of M).
        Per-model reclaim (scheduling/model_reclaim.py) is owed too: V may be of a team that
        uses more of a governed model M than its nominal of it, V runs on M alone, its team
        keeps its nominal of M without it (or, with `victim_keeps_nominal` off, borrows M), J
        goes on one of V's nodes, M's pool lends what J draws once V is gone, and the cohort's
        pool lends T what J draws with V still running (the cycle tries a model's reclaim only
        for a job its totals hold).
        If J has waited the bound (since its submission or last preemption) and V has run
        `min_runtime_s`, J should not be pending at the end of the instant: flag it. If not
        yet, J is due at tau = max(its wait start + bound, V's start + min_runtime_s): the
        engine wakes up for a lender when its preemption delay ends, its deadline passes and
        a victim reaches its minimum run time, all by tau; so a later instant with nothing
        logged since this one means it let J wait past the bound (`check_due`).

        What the engine may legitimately do instead, tolerated so that the rule never flags
        a correct engine (it is conservative, not complete):
        - one more cycle: room that appears in a cycle after J's search (a borrower admitted
          after it, as cycles serve jobs within nominal first) is owed from the next cycle
          only, which may come at the next event: the grace is that cycle, whenever it is;
        - T lost a job of higher priority than J in the instant: J waits behind it until the
          next instant (the inversion guard of cycle.py), so J is not owed anything here;
        - V's priority is above the lowest its team admitted in the instant: V is spared;
        - a reservation hides its nodes and a starving job holds its team's quota, neither
          in the log: nothing is owed once any pending job has waited `starvation_s`;
        - the greedy search looks at `max_preemption_candidates` victims only: nothing is
          owed while more preemptible jobs run than that.
        Not tolerated: a search that misses the one-victim plan, or a cycle that skips it, as
        a shortcut: the promise says room comes back whenever a borrowed job could make it.
        Off where the bound is infinite, or with partial gangs or strict head-of-line."""
        rec, self.instant = self.instant, Instant()
        if not self.watch:
            return
        if not rec.cycle and all(self.state.get(j) == "rejected" for j in rec.fresh):
            return  # no cycle ran: what the engine owed is still due as it was
        self.due = {}
        if not self.waiting:
            return
        t, pol = self.t, self.policy
        lo = {n: u - rec.taken.get(n, ZERO) for n, u in self.usage.items()}
        borrowers = {n for n, u in lo.items() if u.gpu - self.teams[n].nominal.gpu >= GPU_UNIT}
        model_lo = self.model_lo(rec)
        if not borrowers and not model_lo:
            return  # no team borrows a whole GPU, in total or of a model: no victim
        waits = [*self.waiting.values(), *(self.since.get(j, t) for j in rec.moved)]
        if min(waits) + pol.starvation_s <= t:
            return
        running = rec.moved.union(self.started)
        if sum(self.jobs[j].preemptible for j in running) > pol.max_preemption_candidates:
            return
        hi = {n: u + rec.given.get(n, ZERO) for n, u in self.usage.items()}
        victims = self.victims(rec, borrowers, lo, hi, model_lo)
        if not victims:
            return
        draws = {n: (u - self.guaranteed[n]).clamp_low() for n, u in hi.items()}
        firsts: dict[tuple, Victim | None] = {}  # per class: the victim free soonest
        for jid, since in self.waiting.items():
            job = self.jobs[jid]
            if jid in rec.moved or not _one_node_reclaim(job) or job.team not in self.teams:
                continue
            key = self.shape(job)[2]
            if key not in firsts:
                firsts[key] = self.first_victim(job, victims, lo, hi, draws, rec)
            v = firsts[key]
            if v is None:
                continue
            due = max(since + self.bound, v.start + pol.min_runtime_s)
            if due > t:
                self.due[jid] = (due, v)
            elif v.start <= t - pol.min_runtime_s:  # as the engine lists its victims
                self.flag_deficit(job, since, v, t)

    def model_lo(self, rec: Instant) -> dict[tuple[str, str], int]:
        """Per (team, governed model) that the team uses more of than its nominal of it
        (a whole GPU more, wherever in the instant), the least it used in the instant."""
        if not self.models_enforced:
            return {}
        out = {}
        for key, used in self.model_usage.items():
            team, model = key
            lo = used - rec.models_taken.get(key, 0)
            if lo - self.model_quotas[team][model].nominal >= GPU_UNIT:
                out[key] = lo
        return out

    def victims(
        self,
        rec: Instant,
        borrowers: set[str],
        lo: Mapping[str, Resources],
        hi: Mapping[str, Resources],
        model_lo: Mapping[tuple[str, str], int],
    ) -> list[Victim]:
        """Running jobs of `borrowers` (or of teams borrowing a governed model, on it) that a
        lender's job may take, now or once they have run their minimum run time."""
        out: list[Victim] = []
        keep = self.policy.victim_keeps_nominal
        for jid, (start, *_) in self.started.items():
            v = self.jobs[jid]
            team, (r, d, _), reps = v.team, self.shape(v), self.alloc.get(jid, [])
            if not v.preemptible or jid in rec.moved:
                continue
            rank = self.rank(v)
            if rank > rec.floor.get(team, rank):
                continue  # spared: its team admitted a job of lower priority in the instant
            if r.gpu < GPU_UNIT or not reps or any(share for _, _, share in reps):
                continue  # a share may free no whole GPU: the one-node search skips it
            total = team in borrowers
            nominal = self.teams[team].nominal
            # Under Kueue's rule (victim_keeps_nominal off) any job of a borrowing team may go.
            if total and keep:
                total = not (
                    lo[team].gpu - d.gpu < nominal.gpu  # its team would end below its nominal
                    or _dips(d.cpu, lo[team].cpu, hi[team].cpu, nominal.cpu)
                    or _dips(d.mem, lo[team].mem, hi[team].mem, nominal.mem)
                )  # ... or below its nominal CPUs or memory, where above them
            by_model = self.models_of(reps)
            model = next(iter(by_model)) if len(by_model) == 1 else None
            if model is not None:
                left = model_lo.get((team, model))
                if left is None or (
                    keep and left - by_model[model] < self.model_quotas[team][model].nominal
                ):
                    model = None  # its team does not borrow the model, or would end below it
            if not total and model is None:
                continue
            count: dict[int, int] = {}
            for i, _, _ in reps:
                count[i] = count.get(i, 0) + 1
            rooms = []
            for i, k in count.items():
                node = self.cluster.nodes[i]
                free = sum(
                    1
                    for g in range(node.gpus)
                    if node.all_gpus >> g & 1  # not MIG-partitioned
                    if not self.whole.get((i, g))
                    and (i, g) not in self.shares
                    and (i, g) not in rec.touched
                )
                gpus = free * GPU_UNIT + k * r.gpu
                cpu = node.cpu - self.cpu[i] - rec.cpu.get(i, 0) + k * r.cpu
                mem = node.mem - self.mem[i] - rec.mem.get(i, 0) + k * r.mem
                rooms.append((i, gpus, cpu, mem))
            out.append(Victim(v, start, d, tuple(rooms), total, model, by_model))
        return out

    def first_victim(
        self,
        job: TraceJob,
        victims: list[Victim],
        lo: Mapping[str, Resources],
        hi: Mapping[str, Resources],
        draws: Mapping[str, Resources],
        rec: Instant,
    ) -> Victim | None:
        """The victim that alone makes room for `job` soonest, if `job` reclaims at all."""
        team, d = job.team, self.shape(job)[1]
        if (hi[team] + d).first_excess(self.teams[team].nominal):
            return None  # not within its team's nominal: it does not reclaim
        rank = self.rank(job)
        if rec.lost.get(team, rank) > rank:
            return None  # its team just lost a job of higher priority, which goes first
        drawn = sum(draws.values(), ZERO) - draws[team]
        drawn = drawn + (hi[team] + d - self.guaranteed[team]).clamp_low()
        # In an organization tree the pools are per cohort: the usages themselves are tested.
        tree = {**hi, team: hi[team] + d} if self.tree else None
        best: Victim | None = None
        for v in victims:
            u = v.job.team
            if u == team or (best is not None and v.start >= best.start):
                continue
            strict = self.policy.tree_reclaim == "strict"
            if strict and tree is not None and v.total and not self.subtree_lends(team, v, lo):
                v = replace(v, total=False)  # its cohorts hold what it uses: not reclaimable
            if self.reclaims(job, d, v, drawn - draws[u], hi[u], rec, tree):
                best = v
        return best

    def subtree_lends(self, team: str, v: Victim, lo: Mapping[str, Resources]) -> bool:
        """In an organization tree under the strict hierarchical reclaim (`Policy.tree_reclaim`),
        may a reclaim by `team` take `v` whatever the instant's state: each cohort of v's team
        below the one it shares with `team` borrows from its parent at the least usages of the
        instant, and under Berth's rule keeps its quota without v (`victim_rules.Released`;
        cohort usage only grows with team usage)."""
        u = v.job.team
        path = below_common(self.teams[u], self.teams[team])
        if not path:
            return True
        before, _ = cohort_usage(self.teams, lo)
        after, _ = cohort_usage(self.teams, {**lo, u: lo[u] - v.demand})
        keep = self.policy.victim_keeps_nominal
        return all(
            before.get(c.name, ZERO).gpu > c.quota.gpu
            and not (keep and after.get(c.name, ZERO).gpu < c.quota.gpu)
            for c in path
        )

    def reclaims(
        self,
        job: TraceJob,
        d: Resources,
        v: Victim,
        drawn_but_v: Resources,
        v_usage: Resources,
        rec: Instant,
        tree: Mapping[str, Resources] | None = None,
    ) -> bool:
        """Would taking `v` alone make room for `job` (gang demand `d`)? `drawn_but_v`: what
        every team but v's draws on the cohort's pool, the job's team with the job; `tree`,
        in an organization tree: every team's usage, the job's team's with the job."""
        u = v.job.team

        def lends(v_left: Resources) -> bool:
            """Do the pools lend the job's team what it draws, v's team using `v_left`?"""
            if tree is not None:
                return tree_excess(self.teams, {**tree, u: v_left}) is None
            pool = drawn_but_v + (v_left - self.guaranteed[u]).clamp_low()
            return pool.first_excess(self.pool) is None

        # The totals' reclaim (preemption.py): the cohort's pool and the model's with the
        # victim gone (its trial ledgers give back the victims' GPUs of each model too).
        if (
            v.total
            and lends(v_usage - v.demand)
            and any(self.fits(job, d, room, rec, v, any_model=True) for room in v.rooms)
        ):
            return True
        # A model's reclaim (model_reclaim.py), tried where the job fits its team's total quota
        # as it is: the model's pool with the victim gone, on the victim's model.
        return (
            v.model is not None
            and lends(v_usage)
            and any(self.fits(job, d, room, rec, v) for room in v.rooms)
        )

    def accepts(self, job: TraceJob, node: int) -> bool:
        """Is the node's GPU model one the job accepts?"""
        return not job.gpu_model or self.cluster.nodes[node].gpu_model in job.gpu_models

    def fits(
        self,
        job: TraceJob,
        d: Resources,
        room: tuple[int, int, int, int],
        rec: Instant,
        v: Victim | None,
        *,
        any_model: bool = False,
    ) -> bool:
        """Would `job` (gang demand `d`) go on the room's node with `v` gone (None: the job's
        own quota of the node's model alone), as a reclaim of the totals (`any_model`) or of
        the model `v` borrows?"""
        i, g, c, m = room
        if not (g >= d.gpu and c >= d.cpu and m >= d.mem and self.accepts(job, i)):
            return False
        model = self.cluster.nodes[i].gpu_model
        if v is not None and not any_model and v.model != model:
            return False  # a model's reclaim makes room on that model only
        return self.within_model(job, model, rec, v)

    def within_model(self, job: TraceJob, model: str, rec: Instant, v: Victim | None) -> bool:
        """Would `job` on `model` stay within its team's nominal of it, and would the model's
        pool lend what it draws (with `v` gone, where given), wherever in the instant it was
        examined? True where the model is not governed."""
        if not self.models_enforced:
            return True
        q = self.model_quotas.get(job.team, {}).get(model)
        if q is None:
            return True  # not governed: only the total quotas apply
        team = job.team
        used = self.model_usage.get((team, model), 0) + rec.models.get((team, model), 0)
        after = used + self.shape(job)[1].gpu
        if after > q.nominal:
            return False
        if after <= q.guaranteed:
            return True
        # The model's pool, each team's draw at its most (usage plus what it gave back), the
        # job's team with the job, the victim's without it.
        drawn = 0
        for other, quotas in self.model_quotas.items():
            key = (other, model)
            u = after if other == team else self.model_usage.get(key, 0) + rec.models.get(key, 0)
            if v is not None and other == v.job.team:
                u -= v.by_model.get(model, 0)
            drawn += max(u - quotas[model].guaranteed, 0)
        return drawn <= self.model_pool.get(model, 0)

    def check_due(self, t: float) -> None:
        """Time moves on to `t`, nothing logged since the last instant: flag each job whose
        room was due before `t` (`end_instant`)."""
        if not self.due:
            return
        oldest = min(self.waiting.values(), default=math.inf)
        for jid, (due, v) in list(self.due.items()):
            if due >= t:
                continue
            del self.due[jid]
            since = self.waiting.get(jid)
            if since is None or oldest + self.policy.starvation_s <= due:
                continue  # a reservation may hide nodes from then on
            self.flag_deficit(self.jobs[jid], since, v, due, t)

    def flag_deficit(
        self, job: TraceJob, since: float, v: Victim, t: float, late: float | None = None
    ) -> None:
        if (job.job_id, since) in self.deficits:
            return
        self.deficits.add((job.job_id, since))
        d = self.shape(job)[1]
        # The node that held it when it was found owed (usage may have moved since).
        rooms = (r[0] for r in v.rooms if self.fits(job, d, r, Instant(), v, any_model=v.total))
        node = next(rooms, v.rooms[0][0])
        message = (
            f"within team {job.team}'s nominal, waiting since t={since:g} (bound "
            f"{self.bound:g}s), yet not given room though {v.job.job_id} of team "
            f"{v.job.team}, which borrows, could go from {self.cluster.nodes[node].name}"
        )
        if late is not None:
            message += f"; nothing was logged from then to t={late:g}"
        self.flag_at(t, job.job_id, "nominal_deficit", message)


def _one_node_reclaim(job: TraceJob) -> bool:
    """One replica of whole GPUs that may go on any node of the cluster (not a MIG instance,
    though a 7g one counts a whole GPU: it needs its instance, not whole GPUs)."""
    g = round(job.gpus_per_replica * GPU_UNIT)
    whole = g >= GPU_UNIT and g % GPU_UNIT == 0 and not job.mig_profile
    return job.replicas == 1 and whole and job.topology != GPU_GROUP


def _dips(release: int, lo: int, hi: int, nominal: int) -> bool:
    """Could a team whose usage is somewhere in [lo, hi] end below `nominal` by giving up
    `release`, where it was above it (the engine's rule for CPUs and memory)?"""
    return release > 0 and hi > nominal and lo - release < nominal
