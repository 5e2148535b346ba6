"""The store's tables (SQLAlchemy Core), shared by SQLite and PostgreSQL.

- `jobs`: one row per job, its spec, its state and everything on-call asks about it: where it
  runs, why it waits (the reason a cycle wrote; the queue position is computed when read,
  views.py), the last outcome.
  The engine's view of the request (replicas, milli-GPUs, ...) sits next to the spec so that a
  cycle rebuilds its jobs without validating specs again.
- `attempts`: one row per admission: where it ran, how it ended.
- `events`: the audit log, in commit order (every write happens under the store's lock), each
  with the store version its transaction made.
- `engine`: a single row (id 1): reservations, cycle count, the queue sequence, the version;
  its row lock is the store's lock on PostgreSQL.
- `etas`: each waiting job's estimated start, written by the scheduling loop (etas.py).

Times are seconds since the epoch (floats), as the engine counts them. There are no migrations
yet: `Store` creates missing tables (`metadata.create_all`); Alembic comes with the first
change to a released schema.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB

# Job states. A cycle moves queued -> admitted and running -> preempting; the rest are
# reported by whoever runs the job (Store.mark_started, finish, cancel) or by Store.reap.
QUEUED = "queued"
ADMITTED = "admitted"  # placement chosen, not launched yet
RUNNING = "running"
PREEMPTING = "preempting"  # chosen as a victim; its replicas must be stopped
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
REJECTED = "rejected"  # can no longer run on the configured cluster and teams
STATES = (QUEUED, ADMITTED, RUNNING, PREEMPTING, SUCCEEDED, FAILED, CANCELLED, REJECTED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, REJECTED})
LIVE = tuple(s for s in STATES if s not in TERMINAL)
HOLDING = (ADMITTED, RUNNING)  # states that hold GPUs in the engine's accounting

# How an attempt ends (Store.finish). The first three end the job; the last two requeue it.
OUTCOMES = ("succeeded", "failed", "cancelled", "preempted", "lost")

EVENT_TYPES = (
    "submit",
    "admit",
    "start",
    "preempt",
    "finish",
    "fail",
    "requeue",
    "lost",
    "cancel",
    "reject",
    "demote",  # least attained service: the job had its share of service (policy_file.py)
    "promote",  # ... and, demoted, waited long enough to go back up to its priority
)

Json = JSON().with_variant(JSONB(), "postgresql")
ID = String(255)

metadata = MetaData()

jobs = Table(
    "jobs",
    metadata,
    Column("id", ID, primary_key=True),
    Column("name", String(255), nullable=False),
    Column("team", String(255), nullable=False),
    Column("spec", Json, nullable=False),  # JobSpec.model_dump(mode="json")
    Column("state", String(16), nullable=False),
    Column("attempt", Integer, nullable=False, default=0),  # admissions so far
    # The engine's Job (scheduling.jobs.Job), in engine units.
    Column("replicas", Integer, nullable=False),
    Column("gpu", Integer, nullable=False),  # milli-GPUs per replica
    Column("cpu", Integer, nullable=False),  # milli-CPUs per replica
    Column("mem", Integer, nullable=False),  # MiB per replica
    Column("priority", Integer, nullable=False),
    Column("topology", String(32), nullable=False),
    Column("preemptible", Boolean, nullable=False),
    Column("time_limit_s", Float),  # None: no limit (the engine's infinite)
    Column("checkpoint_s", Float),  # the spec's checkpoint_every_s; None: never
    Column("gpu_models", String(1024), nullable=False, default=""),  # '|'-joined; '': any
    Column("mixed_models", Boolean, nullable=False, default=False),
    Column("mig", String(32), nullable=False, default=""),  # a MIG profile per replica; '': none
    # Queue order: a preempted or lost job keeps its place.
    Column("enqueued_at", Float, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("not_before", Float, nullable=False, default=0.0),
    Column("submitted_at", Float, nullable=False),
    Column("admitted_at", Float),
    Column("started_at", Float),
    Column("heartbeat_at", Float),
    # Who launches the admitted attempt, and when it last said so (launch_claim.py).
    Column("launcher", String(128)),
    Column("launch_renewed_at", Float),
    Column("finished_at", Float),
    Column("placement", Json),  # [{"node": name, "gpus": [indices], "share": milli}]
    Column("level", String(32)),
    Column("waits_for", Json, nullable=False, default=list),  # victims still stopping
    Column("preemptions", Integer, nullable=False, default=0),
    # Least attained service (Policy.las): GPU-seconds of the job's ended runs, counted when a
    # cycle preempts it, and whether a cycle demoted it (it stays so).
    Column("attained_gpu_s", Float, nullable=False, default=0.0),
    Column("demoted", Boolean, nullable=False, default=False),
    Column("reason_code", String(32)),
    Column("reason_message", Text),
    Column("reason_level", String(32)),
    Column("reason_resource", String(255)),  # "gpus", or "gpus.<MODEL>": a model's name
    Column("labels", Json, nullable=False, default=dict),
    Column("outcome", String(16)),  # of the last attempt
    Column("message", Text),
    Column("exit_code", Integer),
    Index("ix_jobs_state", "state"),
    Index("ix_jobs_team_state", "team", "state"),
)

attempts = Table(
    "attempts",
    metadata,
    Column("job_id", ID, ForeignKey("jobs.id"), primary_key=True),
    Column("number", Integer, primary_key=True),
    Column("admitted_at", Float, nullable=False),
    Column("started_at", Float),
    Column("ended_at", Float),
    Column("placement", Json, nullable=False),
    Column("level", String(32), nullable=False),
    Column("outcome", String(16)),
    Column("exit_code", Integer),
    Column("message", Text),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("t", Float, nullable=False),
    Column("job_id", ID, nullable=False),
    Column("type", String(16), nullable=False),
    Column("data", Json, nullable=False, default=dict),
    # The store's version its transaction wrote (engine.version): the scheduling loop's
    # in-memory state catches up by versions and sees a gap as one missing (mirror.py).
    Column("version", Integer, nullable=False),
    Index("ix_events_job", "job_id", "id"),
)

engine_row = Table(
    "engine",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("reservations", Json, nullable=False, default=dict),
    Column("last_cycle_at", Float),
    Column("cycles", Integer, nullable=False, default=0),
    Column("next_seq", Integer, nullable=False, default=1),  # queue order across all teams
    # Bumped once by every transaction that writes events, and by every cycle (audit.py).
    Column("version", Integer, nullable=False, default=0),
)

# Each waiting job's estimated start, from the engine run forward (scheduling/eta.py): written
# by the scheduling loop now and then (etas.py), outside the store's lock and its versions (an
# estimate is not a change to the queue). A job without a row: none yet, or too far ahead.
etas = Table(
    "etas",
    metadata,
    Column("job_id", ID, primary_key=True),
    Column("at", Float, nullable=False),
    Column("basis", String(16), nullable=False),  # limits | estimate
    Column("computed_at", Float, nullable=False),
)

# Who runs the scheduling loop (loop.py): one holder at a time, for `expires_at`; renewed by its
# holder while it lives, taken over by another once expired. `epoch` grows with every new
# holder: a cycle commits only while its loop's epoch is the current one (a fence).
leases = Table(
    "leases",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", String(255), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("expires_at", Float, nullable=False),
)
