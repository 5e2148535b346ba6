"""The engine's state kept in memory between cycles, in step with the tables by their versions.

Rebuilding the state from every live row before each cycle costs O(live jobs): half a second
to two seconds at 2,000 nodes and 10,000 queued jobs (issue 13). A `Mirror` is built once
(`build`: every live row, as the old per-cycle rebuild did) and then caught up (`catch_up`):

- Every locked transaction that changes a job writes events stamped with the store version it
  makes (audit.py); the engine row holds the latest version and the cycle count.
- Catching up reads, in one snapshot, the engine row and the events after the last one seen,
  and re-reads only the rows of the jobs those events name. Each such job is dropped from the
  state and put back as its row now says (`_put`), exactly as a build puts every row; the result
  does not depend on the order rows are put back (capacity and quota are sums, queues sorted),
  which is why catching up and building agree (`fingerprint`, tests/test_mirror.py).
- A build again, instead, when the versions seen are not exactly the ones since the mirror's
  (a gap: a write that logged nothing, a pruned log), or when a cycle ran elsewhere (its
  reasons and reservations are not in the events), or when the cluster changed.

What other workloads hold on a live cluster (`held`) is taken after Berth's own jobs, at most
what is free; every change to the running jobs gives it back and takes it again, so that it is
what a build would take.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, RowMapping, func, select

from berth.store.rebuild import job_of, live_rows, placement_of, reservations_of
from berth.store.schema import HOLDING, PREEMPTING, QUEUED, engine_row, events
from berth.store.views import StoreError
from scheduling.admission import Rejection, check_job
from scheduling.cluster import Cluster
from scheduling.mig import free_of
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.resources import GPU_UNIT, ZERO, Resources
from scheduling.state import EngineState


class GapError(RuntimeError):
    """The mirror cannot catch up from the events: build it again."""


class MirrorDiverged(AssertionError):
    """The state kept in memory differs from one built from the tables: a bug."""


@dataclass
class News:
    """What was committed since the mirror's version: the jobs whose rows changed."""

    version: int
    cycles: int
    last_event: int
    reservations: Any  # the engine row's; None: as the mirror has them
    job_ids: frozenset[str]
    rows: dict[str, RowMapping] = field(default_factory=dict)  # live ones among job_ids

    @classmethod
    def none(cls, mirror: Mirror) -> News:
        """Nothing new: the mirror as it is."""
        return cls(mirror.version, mirror.cycles, mirror.last_event, None, frozenset())


class Mirror:
    """An EngineState as of store version `version`, and what does not fit in one: the live
    rows' engine columns (`rows`), the preempting jobs' nodes (`stopping`) and the queued jobs
    that can no longer run (`rejected`, written by the next cycle)."""

    def __init__(
        self,
        cluster: Cluster,
        teams: Mapping[str, Team],
        policy: Policy,
        *,
        held: Mapping[str, Resources] | None = None,
        held_mig: Mapping[str, Mapping[str, int]] | None = None,
        live: bool = False,
    ) -> None:
        self.cluster = cluster
        self.teams = teams
        self.policy = policy
        self.live = live
        self.state = EngineState(cluster, teams, policy)
        self.rows: dict[str, dict[str, Any]] = {}
        self.stopping: dict[str, frozenset[int]] = {}
        self.rejected: dict[str, Rejection] = {}
        self.demoted: set[str] = set()  # demoted by `apply.decide`, not yet written
        self.promoted: dict[str, float] = {}  # promoted back by it (-> its wait's start)
        self.version = 0
        self.cycles = 0
        self.last_event = 0
        self._held: dict[str, Resources] = dict(held or {})
        self._taken: list[tuple[int, int, int, int]] = []  # (node, gpu mask, cpu, mem) held
        self._held_mig = _mig_map(held_mig)
        self._taken_mig: list[tuple[int, int]] = []  # (node, MIG instance) held

    # -- building and catching up -----------------------------------------------------------

    @classmethod
    def build(
        cls,
        cluster: Cluster,
        teams: Mapping[str, Team],
        policy: Policy,
        rows: Iterable[Mapping[str, Any]],
        reservations: Any,
        *,
        held: Mapping[str, Resources] | None = None,
        held_mig: Mapping[str, Mapping[str, int]] | None = None,
        live: bool = False,
    ) -> Mirror:
        """The state of the live `rows` and the engine row's `reservations`; on a `live`
        cluster, less what others hold (`held`: node name -> resources; `held_mig`: node name
        -> MIG profile -> instances)."""
        m = cls(cluster, teams, policy, held=held, held_mig=held_mig, live=live)
        for row in rows:
            m._put(row)
        m._hold()
        m._reserve(reservations)
        return m

    @classmethod
    def load(
        cls,
        conn: Connection,
        cluster: Cluster,
        teams: Mapping[str, Team],
        policy: Policy,
        *,
        held: Mapping[str, Resources] | None = None,
        held_mig: Mapping[str, Mapping[str, int]] | None = None,
        live: bool = False,
    ) -> Mirror:
        """Build from the database (`conn` should read one snapshot: database.snapshot)."""
        eng = conn.execute(select(engine_row).where(engine_row.c.id == 1)).mappings().one()
        last = conn.execute(select(func.max(events.c.id))).scalar() or 0
        m = cls.build(
            cluster,
            teams,
            policy,
            live_rows(conn).values(),
            eng["reservations"],
            held=held,
            held_mig=held_mig,
            live=live,
        )
        m.version, m.cycles, m.last_event = eng["version"], eng["cycles"], last
        return m

    def news(self, conn: Connection) -> News:
        """What was committed after the mirror's version, with the changed jobs' rows. Raises
        GapError when that cannot be known from the events (see the module docstring)."""
        eng = conn.execute(select(engine_row).where(engine_row.c.id == 1)).mappings().one()
        if eng["cycles"] != self.cycles:
            raise GapError(f"a cycle ran elsewhere (cycle {eng['cycles']}, mine {self.cycles})")
        news = News(
            eng["version"], eng["cycles"], self.last_event, eng["reservations"], frozenset()
        )
        if eng["version"] == self.version:
            return news
        q = select(events.c.id, events.c.job_id, events.c.version).where(
            events.c.id > self.last_event
        )
        ids, versions, last = set(), set(), self.last_event
        for event_id, job_id, version in conn.execute(q):
            ids.add(job_id)
            versions.add(version)
            last = max(last, event_id)
        if versions != set(range(self.version + 1, eng["version"] + 1)):
            raise GapError(
                f"versions {self.version + 1}..{eng['version']} expected in the events after "
                f"{self.last_event}, found {len(versions)} of them"
            )
        news.last_event, news.job_ids = last, frozenset(ids)
        news.rows = dict(live_rows(conn, ids)) if ids else {}
        return news

    def absorb(self, news: News) -> None:
        """Make the news true here: every job it names as its row now says."""
        if news.job_ids:
            self._unhold()
            for job_id in news.job_ids:
                self._drop(job_id)
                row = news.rows.get(job_id)
                if row is not None:
                    self._put(row)
            self._hold()
        self.version, self.last_event = news.version, news.last_event
        if news.reservations is not None:
            self._reserve(news.reservations)

    def set_held(
        self, held: Mapping[str, Resources], held_mig: Mapping[str, Mapping[str, int]] | None = None
    ) -> None:
        """What other workloads hold now (a live cluster's discovery)."""
        held, mig = dict(held), _mig_map(held_mig)
        if held != self._held or mig != self._held_mig:
            self._unhold()
            self._held, self._held_mig = held, mig
            self._hold()

    # -- the rows ---------------------------------------------------------------------------

    def _put(self, row: Mapping[str, Any]) -> None:
        job_id, st = row["id"], row["state"]
        cluster, state = self.cluster, self.state
        if st != PREEMPTING and row["attained_gpu_s"]:  # before the run's demotion is timed
            state.attained[job_id] = row["attained_gpu_s"]
        if st == PREEMPTING:
            placement = placement_of(cluster, job_id, row["placement"], row["level"], live=True)
            self.stopping[job_id] = frozenset(placement.nodes)
        elif st in HOLDING:
            job = job_of(row)
            if job.team not in self.teams:
                raise StoreError(
                    f"job {job_id} ({st}) belongs to team {job.team!r}, which teams.yaml no "
                    "longer has; put the team back until the job ends, or cancel the job"
                )
            placement = placement_of(
                cluster, job_id, row["placement"], row["level"], live=self.live
            )
            start = row["started_at"] if row["started_at"] is not None else row["admitted_at"]
            try:
                state.restore_running(
                    job,
                    placement,
                    start,
                    row["preemptions"],
                    enqueued=row["enqueued_at"],
                    seq=row["seq"],
                )
            except ValueError as e:  # Capacity.take: GPUs held twice; the rows are corrupt
                raise StoreError(f"job {job_id}: its placement is not free: {e}") from e
        elif st == QUEUED:
            job = job_of(row)
            rejection = check_job(
                job, cluster, self.teams, quotas=self.policy.quotas, fit=not self.live
            )
            if rejection is not None:  # the cluster or the teams changed since it was submitted
                self.rejected[job_id] = rejection
            else:
                state.restore_pending(
                    job,
                    row["enqueued_at"],
                    row["seq"],
                    row["not_before"],
                    row["preemptions"],
                    since=row.get("last_ended_at"),
                )
        self.rows[job_id] = dict(row)

    def _drop(self, job_id: str) -> None:
        self.state.forget(job_id)
        self.stopping.pop(job_id, None)
        self.rejected.pop(job_id, None)
        self.rows.pop(job_id, None)

    def _reserve(self, saved: Any) -> None:
        """The engine row's reservations, of jobs still queued."""
        kept = reservations_of(self.cluster, saved)
        self.state.reservations = {k: v for k, v in kept.items() if k in self.state.pending}

    def _hold(self) -> None:
        capacity = self.state.capacity
        for name, res in self._held.items():
            node = self.cluster.by_name.get(name)
            if node is None:
                continue
            i = node.index
            before = (capacity.free[i], capacity.free_cpu[i], capacity.free_mem[i])
            capacity.hold_outside(i, res.gpu // GPU_UNIT, res.cpu, res.mem)
            mask = before[0] & ~capacity.free[i]
            self._taken.append(
                (i, mask, before[1] - capacity.free_cpu[i], before[2] - capacity.free_mem[i])
            )
        # Instances others hold: that many free ones of each profile, the highest first (the
        # device plugin, not Berth, chose which; Berth's own keep theirs). Their CPUs and
        # memory are in `held` already.
        for name, profiles in self._held_mig.items():
            node = self.cluster.by_name.get(name)
            if node is None or not capacity.mig_free:
                continue
            i = node.index
            for profile, count in profiles.items():
                for k in reversed(free_of(capacity, i, profile)[-count:] if count else []):
                    capacity.take_instance(i, k, 0, 0)
                    self._taken_mig.append((i, k))

    def _unhold(self) -> None:
        for i, mask, cpu, mem in self._taken:
            self.state.capacity.give(i, mask, cpu, mem)
        self._taken = []
        for i, k in self._taken_mig:
            self.state.capacity.give_instance(i, k, 0, 0)
        self._taken_mig = []

    # -- after this process's own cycle (apply.py) -------------------------------------------

    def rehold(self) -> None:
        """Take what others hold again, after the running jobs changed (as a build would)."""
        if self._taken or self._taken_mig:
            self._unhold()
            self._hold()

    def ended(self, job_id: str) -> None:
        """The job's row became terminal."""
        self._drop(job_id)

    def stopped(self, job_id: str) -> None:
        """The job was chosen as a victim: preempting in the tables, out of the engine."""
        self.state.forget(job_id)  # EngineState.apply queued it again
        row = self.rows[job_id]
        row["state"] = PREEMPTING
        placed = placement_of(self.cluster, job_id, row["placement"], row["level"], live=True)
        self.stopping[job_id] = frozenset(placed.nodes)

    def stopping_on(self, nodes: Collection[int]) -> set[str]:
        """The preempting jobs with replicas on any of `nodes`."""
        nodes = set(nodes)
        return {j for j, ns in self.stopping.items() if ns & nodes}

    # -- checking -----------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """Everything a cycle reads, in a form two mirrors can be compared by (==)."""
        s = self.state
        cap = s.capacity
        return {
            "running": {
                j: (r.job, r.placement, r.start_time, r.preemptions, _place(s._origin.get(j)))
                for j, r in s.running.items()
            },
            "pending": {
                j: (p.job, p.enqueued, p.seq, p.not_before, p.since, s.preemptions.get(j, 0))
                for j, p in s.pending.items()
            },
            "queues": {
                t: {k: [p.job.id for p in q] for k, q in classes.items()}
                for t, classes in s.queues.items()
            },
            "free": (list(cap.free), list(cap.free_cpu), list(cap.free_mem)),
            "shares": {i: dict(v) for i, v in cap.shares.items() if v},
            "usage": dict(s.quota.usage),
            # what the root's pool and each cohort of an organization tree lend out
            "pools": (
                s.quota.pool_used,
                {c: u for c, u in s.quota.cohort_used.items() if u != ZERO},
            ),
            "by_start": [r.job.id for r in s.running_by_start],
            "preemptible": {
                t: [r.job.id for r in q] for t, q in s.preemptible_by_team.items() if q
            },
            "preemptible_gpus": {t: g for t, g in s.preemptible_gpus.items() if g},
            "priorities": {
                t: {p: n for p, n in c.items() if n} for t, c in s.running_priorities.items()
            },
            "reservations": dict(s.reservations),
            "attained": dict(s.attained),
            "demotions": s.next_demotion(),
            "promotions": s.next_promotion(),
            "stopping": dict(self.stopping),
            "rejected": dict(self.rejected),
            "rows": self.rows,
        }

    def check_against(self, fresh: Mirror) -> None:
        """Raise MirrorDiverged unless this mirror holds what `fresh` (just built) holds."""
        mine, theirs = self.fingerprint(), fresh.fingerprint()
        differ = [k for k in mine if mine[k] != theirs[k]]
        if (self.version, self.cycles) != (fresh.version, fresh.cycles):
            differ.append(
                f"version {self.version}/{fresh.version}, cycles {self.cycles}/{fresh.cycles}"
            )
        if differ:
            details = []
            for key in differ[:3]:
                a, b = mine.get(key), theirs.get(key)
                if isinstance(a, dict) and isinstance(b, dict):
                    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))[:5]
                    details.append(f"{key}: {[(k, a.get(k), b.get(k)) for k in keys]}")
            raise MirrorDiverged(
                f"the in-memory state differs from a rebuild in {', '.join(map(str, differ))}; "
                + "; ".join(details)
            )


def _place(p: Any) -> tuple | None:
    return None if p is None else (p.enqueued, p.seq)


def _mig_map(held_mig: Mapping[str, Mapping[str, int]] | None) -> dict[str, dict[str, int]]:
    return {name: dict(p) for name, p in (held_mig or {}).items() if p}
