"""The audit log: one `events` row per thing that happened to a job, in commit order.

Every write happens under the store's lock, so event ids follow commit order and replaying the
log in id order replays the store's history (the concurrency tests do exactly that). `data`
carries what on-call needs without joining other tables: the attempt, the placement of an
admission, who preempted whom, an outcome with its exit code and message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, select

from berth.store.database import bump_version
from berth.store.schema import EVENT_TYPES, events
from berth.store.views import Event


def emit(conn: Connection, t: float, job_id: str, kind: str, **data: Any) -> None:
    """Log an event, with the store version its (locked) transaction makes."""
    if kind not in EVENT_TYPES:  # a typo here would hide a job's history from on-call
        raise ValueError(f"unknown event type {kind!r}; one of {EVENT_TYPES}")
    version = bump_version(conn)
    conn.execute(events.insert().values(t=t, job_id=job_id, type=kind, data=data, version=version))


def read_events(conn: Connection, job_id: str | None = None, after_id: int = 0) -> list[Event]:
    q = select(events).where(events.c.id > after_id).order_by(events.c.id)
    if job_id is not None:
        q = q.where(events.c.job_id == job_id)
    return [_event(r) for r in conn.execute(q).mappings()]


def _event(r: Mapping[str, Any]) -> Event:
    return Event(r["id"], r["t"], r["job_id"], r["type"], dict(r["data"] or {}))
