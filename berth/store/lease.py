"""The scheduling loop's lease: one process runs cycles, another takes over when it dies.

A row in `leases` names the holder and when its lease expires. Taking or renewing it is one
locked transaction (milliseconds). The holder renews it well before it expires; a process
that finds it expired takes it, with a new `epoch`. A cycle commits only while its loop holds
the current epoch (`check`, under the same lock as the commit): a loop that stalled past its
lease (a long GC pause, a frozen VM) and woke up cannot write next to its successor.

Times are the database clients' clocks (`time.time()`), as everywhere in the store: the
machines that run loops must keep their clocks in step (NTP) to well within `ttl_s`.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, select, update

from berth.store.database import locked
from berth.store.schema import leases

LOOP = "scheduling-loop"


class LeaseLost(RuntimeError):
    """Another process holds the loop's lease now: this one must stop deciding."""


@dataclass
class Lease:
    """This process's claim on the lease `name` of the store behind `engine`."""

    engine: Engine
    ttl_s: float = 15.0
    name: str = LOOP
    holder: str = ""
    epoch: int | None = None  # the epoch held, None while not held

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0 seconds, got {self.ttl_s!r}")
        if not self.holder:
            self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    def claim(self, now: float | None = None) -> bool:
        """Take the lease if it is free or expired, renew it if held; True if held now."""
        now = time.time() if now is None else now
        with locked(self.engine) as conn:
            row = conn.execute(select(leases).where(leases.c.name == self.name)).mappings().first()
            if row is None:
                conn.execute(
                    leases.insert().values(
                        name=self.name, holder=self.holder, epoch=1, expires_at=now + self.ttl_s
                    )
                )
                self.epoch = 1
            elif row["holder"] == self.holder and row["epoch"] == self.epoch:
                conn.execute(
                    update(leases)
                    .where(leases.c.name == self.name)
                    .values(expires_at=now + self.ttl_s)
                )
            elif row["expires_at"] < now:
                self.epoch = row["epoch"] + 1
                conn.execute(
                    update(leases)
                    .where(leases.c.name == self.name)
                    .values(holder=self.holder, epoch=self.epoch, expires_at=now + self.ttl_s)
                )
            else:
                self.epoch = None
        return self.epoch is not None

    def check(self, conn: Connection, now: float | None = None) -> None:
        """Under the store's lock: raise LeaseLost unless this process holds the lease."""
        now = time.time() if now is None else now
        row = conn.execute(select(leases).where(leases.c.name == self.name)).mappings().first()
        if (
            self.epoch is None
            or row is None
            or (row["holder"], row["epoch"]) != (self.holder, self.epoch)
            or row["expires_at"] < now
        ):
            held = "nobody" if row is None else f"{row['holder']} (epoch {row['epoch']})"
            self.epoch = None
            raise LeaseLost(f"the {self.name} lease is held by {held}, not by {self.holder}")

    def holder_now(self, now: float | None = None) -> str | None:
        """Who holds an unexpired lease now, or None."""
        now = time.time() if now is None else now
        with self.engine.connect() as conn:
            row = conn.execute(select(leases).where(leases.c.name == self.name)).mappings().first()
        return row["holder"] if row is not None and row["expires_at"] >= now else None

    def release(self) -> None:
        """Give the lease up at once (a clean shutdown): another may take it now."""
        if self.epoch is None:
            return
        with locked(self.engine) as conn:
            conn.execute(
                update(leases)
                .where(
                    leases.c.name == self.name,
                    leases.c.holder == self.holder,
                    leases.c.epoch == self.epoch,
                )
                .values(expires_at=0.0)
            )
        self.epoch = None
