"""The engine's durable, shared state: jobs in SQL tables, one cycle per locked transaction.

Many Airflow triggers and workers poll at once. Each call below is one transaction under the
store's lock (database.py), so a cycle rebuilds the engine's state from what is committed, runs
the pure `cycle.schedule`, and writes its decisions before anyone else can look: no GPU is ever
given twice, however many pollers there are.

A job's way through the store (states in schema.py):

    submit -> queued --schedule--> admitted --mark_started--> running --finish--> succeeded
                 ^                    |  \\                       |                failed
                 |                    |   `--schedule (victim)--> preempting     cancelled
                 `--finish(preempted | lost), reap, retry(failed)-----'

- `launchable(job)`: admitted, and no job it waits for (`waits_for`: victims and any job still
  stopping on its nodes) is still preempting. Launch only then.
- Preempted and lost attempts go back to the queue at their old place and use no retry;
  failed ones end the job, and Airflow's retry calls `retry`, which queues a new attempt.
- `reap` ends attempts whose worker went silent for longer than the lease, so a dead worker
  leaks no GPU.
- Events (audit.py): submit, admit, start, preempt, finish, fail, requeue, lost, cancel, reject.

Cycles run on an engine state this Store keeps in memory and catches up from what others
committed (mirror.py), and decide outside the store's lock; the lock is held only to check that
nothing the cycle decided about moved meanwhile and to write the decisions (apply.py).

Partial-gang policies (`quota-spread`) are simulator-only and refused here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, func, null, select, update

from berth.spec import JobSpec, check_spec
from berth.store import etas, launch_claim, lifecycle
from berth.store.audit import read_events
from berth.store.database import connect, create_schema, locked, reading
from berth.store.etas import StoredEta
from berth.store.lease import Lease
from berth.store.positions import queue_positions
from berth.store.runner import CycleRunner
from berth.store.schema import (
    ADMITTED,
    CANCELLED,
    FAILED,
    HOLDING,
    LIVE,
    OUTCOMES,
    PREEMPTING,
    QUEUED,
    RUNNING,
    STATES,
    TERMINAL,
    events,
    jobs,
)
from berth.store.views import (
    CycleReport,
    DuplicateJobError,
    Event,
    JobStateError,
    JobStatus,
    TeamUsage,
    UnsupportedPolicyError,
    add_models,
    gpus_of,
    model_rows,
    status_from_row,
)
from berth.store.wakeup import listen
from scheduling.cluster import Cluster
from scheduling.models import model_gpus
from scheduling.policy import Policy, foreign_strategies, get_policy
from scheduling.quota import Team, model_quotas
from scheduling.resources import Resources

DEFAULT_LEASE_S = 300.0  # a worker silent this long is presumed dead (reap)


@dataclass(frozen=True)
class ClusterView:
    """The cluster as a discovery sees it now, and what other workloads hold on its nodes
    (node name -> resources; and MIG instances, node name -> profile -> count): what a live
    cluster source gives the store."""

    cluster: Cluster
    held: Mapping[str, Resources] = field(default_factory=dict)
    held_mig: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


class Store:
    """Jobs, attempts and events in SQLite (`sqlite:///path/berth.db`, one machine) or
    PostgreSQL (`postgresql+psycopg://...`, the cluster shape). Creates missing tables; there
    are no migrations yet (Alembic comes with the first change to a released schema).

    The cluster is declared (`cluster`) or live: `live` is called for the cluster as it is now
    and what others hold on it (a Kubernetes discovery, which caches its answer for a while),
    before every submission and cycle; see rebuild.py for what a live cluster changes.

    Times default to `time.time()`; tests pass `now` to drive a virtual clock.
    """

    def __init__(
        self,
        url: str,
        cluster: Cluster | None,
        teams: Mapping[str, Team],
        policy: Policy | str = "berth",
        *,
        busy_timeout_s: float = 60.0,
        live: Callable[[], ClusterView] | None = None,
    ) -> None:
        if (cluster is None) == (live is None):
            raise ValueError("Store: give exactly one of cluster (declared) and live (discovered)")
        self._cluster = cluster
        self._live = live
        self.teams = teams
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        foreign = foreign_strategies(self.policy)
        if foreign:
            raise UnsupportedPolicyError(
                f"policy: {self.policy.name!r} is a baseline's ({', '.join(foreign)}), which "
                "only the simulator models; use 'berth' or a policy file based on it with the "
                "store"
            )
        self.engine = connect(url, busy_timeout_s)
        create_schema(self.engine)
        self.runner = CycleRunner(self.engine, teams, self.policy, live=live is not None)

    @property
    def cluster(self) -> Cluster:
        """The cluster the store schedules on (for a live one, as last discovered)."""
        return self._view().cluster

    def _view(self) -> ClusterView:
        if self._live is not None:
            return self._live()
        assert self._cluster is not None
        return ClusterView(self._cluster)

    def close(self) -> None:
        """Close pooled connections (a process that forks should call this first)."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes: each one transaction under the lock ----------------------------------------

    def submit(
        self,
        spec: JobSpec,
        *,
        job_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        now: float | None = None,
    ) -> JobStatus:
        """Queue a job; raises the SpecError of `check_spec` (writing nothing) if it can never
        run (on a live cluster: whatever its size now). Idempotent: a job id already known with
        the same spec returns its status as is (a resumed Airflow task resubmits); with a
        different spec it is a DuplicateJobError."""
        live = self._live is not None  # a discovered cluster may grow: jobs wait, not fail
        quotas = self.policy.quotas
        problem = check_spec(spec, self.cluster, self.teams, quotas=quotas, fit=not live)
        if problem is not None:
            raise problem
        job_id = _job_id(job_id) if job_id is not None else f"{spec.name}-{uuid.uuid4().hex[:8]}"
        labels = _labels(labels)
        now = _now(now)
        dumped = spec.model_dump(mode="json")
        with locked(self.engine) as conn:
            row = _find(conn, job_id)
            if row is not None and row["spec"] != dumped:
                raise DuplicateJobError(
                    f"job_id: {job_id!r} already exists with a different spec; give a new "
                    "job_id, or leave it out to get a fresh one"
                )
            if row is None:
                lifecycle.insert(conn, spec, dumped, job_id, labels, now)
        return self.status(job_id)  # its queue position is read outside the lock

    def schedule(self, now: float | None = None, *, lease: Lease | None = None) -> CycleReport:
        """Run one scheduling cycle and write its decisions (runner.py, apply.py); with a
        `lease` (the scheduling loop's), only while it is held (LeaseLost otherwise)."""
        return self.runner.schedule(self._view(), _now(now), lease)

    def estimate_starts(self, now: float | None = None) -> int:
        """Estimate every waiting job's start by running the engine forward from the state of
        the last commit (scheduling/eta.py) and store it (etas.py); returns how many got one.
        The scheduling loop calls it now and then; it takes no lock and changes no version."""
        return etas.refresh(self, self.runner.forward_state(self._view()), _now(now))

    def etas(self, job_ids: Iterable[str]) -> dict[str, StoredEta]:
        """The last estimated start of each of `job_ids` that has one."""
        return etas.read(self, list(job_ids))

    def changed(self) -> bool:
        """Whether anything was committed since this Store's last cycle (or it has none)."""
        return self.runner.changed()

    def self_check(self) -> None:
        """Compare the in-memory state with one built afresh from the tables; raises
        MirrorDiverged naming what differs. For tests and a periodic check in the loop."""
        self.runner.self_check(self._view())

    def decided(self, job_id: str, timeout_s: float) -> JobStatus:
        """The job's status once a cycle has decided about it (admitted, or queued with a
        reason), or at `timeout_s`; woken by committed changes (wakeup.py), not by polling.
        What a caller does while the scheduling loop leads instead of running a cycle."""
        listener = listen(self.engine)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                st = self.status(job_id)
                left = deadline - time.monotonic()
                if st.state != QUEUED or st.reason_code is not None or left <= 0:
                    return st
                listener.wait(min(left, 1.0))
        finally:
            listener.close()

    def loop_holder(self) -> str | None:
        """The scheduling loop that leads now (lease.py), or None: then callers run cycles."""
        return Lease(self.engine).holder_now()

    def mark_started(self, job_id: str, attempt: int, *, now: float | None = None) -> JobStatus:
        """The job's replicas were launched for `attempt`. Repeating it is harmless."""
        now = _now(now)
        with locked(self.engine) as conn:
            row = _get(conn, job_id)
            lifecycle.check_attempt(row, attempt)
            if row["state"] == RUNNING:
                return status_from_row(row)
            lifecycle.require(row, (ADMITTED,), "mark_started")
            stopping = lifecycle.still_stopping(conn, row["waits_for"])
            if stopping:
                raise JobStateError(
                    f"job {job_id} may not start yet: {', '.join(stopping)} still stopping on "
                    "its GPUs; poll launchable() and start it when it returns True"
                )
            lifecycle.start(conn, row, now)
            return status_from_row(_get(conn, job_id))

    def claim_launch(
        self,
        job_id: str,
        attempt: int,
        holder: str,
        *,
        lease_s: float,
        now: float | None = None,
    ) -> str | None:
        """Claim, or renew, the launch of the admitted `attempt` for `holder` (launch_claim.py:
        one launcher at a time). None if it is `holder`'s now; else the other launcher, whose
        claim was renewed within `lease_s`. Raises JobStateError once the job is no longer
        admitted (StaleAttemptError for another attempt)."""
        now = _now(now)
        with locked(self.engine) as conn:
            row = _get(conn, job_id)
            lifecycle.check_attempt(row, attempt)
            lifecycle.require(row, (ADMITTED,), "claim_launch")
            return launch_claim.claim(conn, row, holder, now, lease_s)

    def heartbeat(
        self, job_id: str, *, attempt: int | None = None, now: float | None = None
    ) -> JobStatus:
        """The worker is alive; returns the status, whose state tells it to stop (preempting,
        cancelled) or that it speaks for a reaped attempt (StaleAttemptError)."""
        now = _now(now)
        with locked(self.engine) as conn:
            row = _get(conn, job_id)
            if attempt is not None:
                lifecycle.check_attempt(row, attempt)
            if row["state"] in (ADMITTED, RUNNING, PREEMPTING):
                conn.execute(update(jobs).where(jobs.c.id == job_id).values(heartbeat_at=now))
            return status_from_row(_get(conn, job_id))

    def finish(
        self,
        job_id: str,
        outcome: str,
        *,
        exit_code: int | None = None,
        message: str = "",
        attempt: int | None = None,
        now: float | None = None,
    ) -> JobStatus:
        """End the current attempt. succeeded, failed and cancelled end the job; preempted (its
        replicas have stopped) and lost send it back to the queue at its old place, and so does
        a failure with an exit code the job declares recoverable (ended as lost, using no
        retry: `lifecycle.recovered`); the status returned tells which."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome: must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
        now = _now(now)
        with locked(self.engine) as conn:
            row = _get(conn, job_id)
            if attempt is not None:
                lifecycle.check_attempt(row, attempt)
            lifecycle.require(row, (ADMITTED, RUNNING, PREEMPTING), f"finish({outcome})")
            outcome, message = lifecycle.recovered(conn, row, outcome, exit_code, message)
            lifecycle.end_attempt(conn, row, outcome, exit_code, message, now)
            return status_from_row(_get(conn, job_id))

    def retry(self, job_id: str, not_before: float = 0.0, *, now: float | None = None) -> JobStatus:
        """A failed job queues again for a new attempt (Airflow decides to retry; the store
        records it), at the end of its team's queue, not before `not_before`."""
        now = _now(now)
        with locked(self.engine) as conn:
            row = _get(conn, job_id)
            lifecycle.require(row, (FAILED,), "retry")
            lifecycle.requeue_new(conn, row, not_before, now)
            return status_from_row(_get(conn, job_id))

    def cancel(self, job_id: str, *, message: str = "", now: float | None = None) -> JobStatus:
        """End the job wherever it is; its GPUs are free for the next cycle. The caller stops
        its replicas (the operator's on_kill does, then cancels). A job that already ended
        keeps its state."""
        now = _now(now)
        with locked(self.engine) as conn:
            row = _get(conn, job_id)
            if row["state"] in TERMINAL:
                return status_from_row(row)
            if row["state"] == QUEUED:
                lifecycle.cancel_queued(conn, row, message, now)
            else:
                lifecycle.end_attempt(conn, row, CANCELLED, None, message, now)
            return status_from_row(_get(conn, job_id))

    def reap(self, now: float | None = None, lease_s: float = DEFAULT_LEASE_S) -> list[str]:
        """Attempts whose worker was silent for `lease_s` (last heartbeat, else start, else
        admission) end as lost and requeue; a preempting one counts as stopped. Returns them."""
        if not lease_s > 0:
            raise ValueError(f"lease_s: must be > 0 seconds, got {lease_s!r}")
        now = _now(now)
        cutoff = now - lease_s
        q = select(jobs).where(
            jobs.c.state.in_((ADMITTED, RUNNING, PREEMPTING)), lifecycle.silent_since(cutoff)
        )
        with locked(self.engine) as conn:
            silent = list(conn.execute(q).mappings())
            for row in silent:
                lifecycle.end_attempt(
                    conn, row, "lost", None, f"no heartbeat for {lease_s:g} s", now, by="reap"
                )
            return [r["id"] for r in silent]

    # -- reads: the last committed state, no lock -------------------------------------------

    def launchable(self, job_id: str) -> bool:
        """True when the job is admitted and nothing it waits for is still stopping."""
        with reading(self.engine) as conn:
            row = _get(conn, job_id)
            if row["state"] != ADMITTED:
                return False
            return not lifecycle.still_stopping(conn, row["waits_for"])

    def status(self, job_id: str) -> JobStatus:
        with reading(self.engine) as conn:
            return self._statuses(conn, [_get(conn, job_id)])[0]

    def statuses(self, job_ids: Iterable[str]) -> dict[str, JobStatus]:
        """The known jobs among `job_ids`, in one query (unknown ids are left out)."""
        q = select(jobs).where(jobs.c.id.in_(list(job_ids)))
        with reading(self.engine) as conn:
            return {s.id: s for s in self._statuses(conn, conn.execute(q).mappings())}

    def _statuses(self, conn: Connection, rows: Iterable[Mapping[str, Any]]) -> list[JobStatus]:
        """Statuses of `rows`, the queued ones with their queue positions (positions.py)."""
        rows = list(rows)
        teams = {r["team"] for r in rows if r["state"] == QUEUED}
        positions = queue_positions(conn, self.policy, teams)
        return [status_from_row(r, positions.get(r["id"])) for r in rows]

    def change_token(self) -> int:
        """The last event's id. It moves with every submission, admission, start, end,
        requeue and cancellation (not with heartbeats), so a poller whose token did not move
        has nothing new to decide, bar time-based changes (`CycleReport.next_wakeup`)."""
        with reading(self.engine) as conn:
            return int(conn.execute(select(func.max(events.c.id))).scalar() or 0)

    def jobs(self, team: str | None = None, states: Iterable[str] | None = None) -> list[JobStatus]:
        """Jobs in queue order (seq), optionally of one team and in some states."""
        q = select(jobs).order_by(jobs.c.seq)
        if team is not None:
            q = q.where(jobs.c.team == team)
        if states is not None:
            states = list(states)
            bad = [s for s in states if s not in STATES]
            if bad:
                raise ValueError(f"states: unknown {bad}; use some of {', '.join(STATES)}")
            q = q.where(jobs.c.state.in_(states))
        with reading(self.engine) as conn:
            return self._statuses(conn, conn.execute(q).mappings())

    def events(self, job_id: str | None = None, *, after_id: int = 0) -> list[Event]:
        """The audit log in commit order: one job's, or everyone's after `after_id`."""
        with reading(self.engine) as conn:
            return read_events(conn, job_id, after_id)

    def usage(self) -> dict[str, TeamUsage]:
        """Per team: GPUs held by admitted and running jobs against nominal and ceiling."""
        cluster = self.cluster
        # Rows per model on a cluster of several models or where teams declare model keys;
        # only then are the placements read (JSON, one per running job).
        quotas, _ = model_quotas(self.teams, model_gpus(cluster))
        per_model = len(cluster.models) > 1 or bool(quotas)
        placement = jobs.c.placement if per_model else null().label("placement")
        q = select(jobs.c.team, jobs.c.state, jobs.c.gpu, jobs.c.replicas, placement).where(
            jobs.c.state.in_(LIVE)
        )
        held: dict[str, int] = dict.fromkeys(self.teams, 0)
        stopping = dict(held)
        queued = dict(held)
        running = dict(held)
        by_model: dict[tuple[str, str], int] = {}
        with reading(self.engine) as conn:
            for team, state, gpu, replicas, placement in conn.execute(q):
                if team not in held:
                    continue
                if state in HOLDING:
                    held[team] += gpu * replicas
                    running[team] += 1
                    add_models(by_model, team, placement or (), cluster)
                elif state == PREEMPTING:
                    stopping[team] += gpu * replicas
                else:
                    queued[team] += 1
        return {
            name: TeamUsage(
                team=name,
                gpus=held[name] / 1000,
                nominal=gpus_of(t.nominal.gpu),
                ceiling=gpus_of(t.ceiling.gpu),
                stopping_gpus=stopping[name] / 1000,
                queued=queued[name],
                running=running[name],
                models=model_rows(name, by_model, quotas.get(name, {}), cluster)
                if per_model
                else (),
                cohorts=tuple(c.name for c in t.cohorts),
            )
            for name, t in self.teams.items()
        }


def _now(now: float | None) -> float:
    return time.time() if now is None else float(now)


def _find(conn: Connection, job_id: str) -> Mapping[str, Any] | None:
    return conn.execute(select(jobs).where(jobs.c.id == job_id)).mappings().first()


def _get(conn: Connection, job_id: str) -> Mapping[str, Any]:
    row = _find(conn, job_id)
    if row is None:
        raise lifecycle.unknown(job_id)
    return row


def _job_id(job_id: Any) -> str:
    if not isinstance(job_id, str) or not job_id.strip() or len(job_id) > 255:
        raise ValueError(
            f"job_id: must be a non-blank string of at most 255 characters, got {job_id!r}; "
            "leave it out to get '<name>-<8 hex digits>'"
        )
    return job_id


def _labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise ValueError(f"labels: must be a mapping of strings, got {type(labels).__name__}")
    bad = {k: v for k, v in labels.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise ValueError(
            f"labels: keys and values must be strings, got {bad!r}; e.g. "
            "{'dag_id': 'train', 'try_number': '1'}"
        )
    return dict(labels)
