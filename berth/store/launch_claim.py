"""One launcher per admitted attempt, however many triggerers share the store.

A launch is not idempotent: two launchers of one attempt would start two gangs on the same
GPUs. Yet two can meet: Airflow runs a trigger in a second triggerer once the first missed its
heartbeats for a while, and the first goes on running it until it notices; a run task's fast
path can race the trigger of its own earlier try. So a launcher claims the attempt in the
store before it looks for leftovers or creates anything (`Store.claim_launch`), and renews
the claim while it launches (`held_launch`). Whoever finds the claim held waits: the holder
either starts the job (the waiter then sees it running) or dies, and its claim lapses
`lease_s` after its last renewal; the next launcher then takes over and finds what the dead
one left (`Runtime.reattach`).

The lease (`BERTH_LAUNCH_LEASE_S`, 60 s by default; berth/settings.py) is short against the
reaper's, so a dead launcher's job waits about that long, and long against one renewal's round
trip, which a busy store may take seconds to answer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, update

from berth.store.schema import jobs
from berth.store.views import JobStateError

if TYPE_CHECKING:
    from berth.store.store import Store

log = logging.getLogger(__name__)


class LaunchClaimed(RuntimeError):
    """Another launcher holds the attempt's launch (its claim is fresh)."""

    def __init__(self, job_id: str, attempt: int, holder: str, lease_s: float) -> None:
        super().__init__(
            f"job {job_id} attempt {attempt}: launcher {holder} is launching it; waiting for "
            f"it to start the job or for its claim to lapse ({lease_s:g} s after it last "
            "renewed it)"
        )
        self.holder = holder


def new_holder() -> str:
    """A launcher's name: where it runs, and unique per launch."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def claim(
    conn: Connection, row: Mapping[str, Any], holder: str, now: float, lease_s: float
) -> str | None:
    """Claim or renew the launch of the row's attempt (admitted; the caller checked) for
    `holder`. None if it is `holder`'s now; else the launcher whose claim is still fresh."""
    other, renewed = row["launcher"], row["launch_renewed_at"]
    if other not in (None, holder) and renewed is not None and now - renewed < lease_s:
        return str(other)
    conn.execute(
        update(jobs).where(jobs.c.id == row["id"]).values(launcher=holder, launch_renewed_at=now)
    )
    return None


@contextmanager
def held_launch(
    store: Store, job_id: str, attempt: int, *, lease_s: float, max_hold_s: float | None = None
) -> Iterator[str]:
    """Claim the attempt's launch (raises LaunchClaimed if another launcher holds it) and
    keep it renewed from a thread until the block ends, or for `max_hold_s` at most (ten
    leases unless given): a launch that hangs (a request that never returns) must not hold
    the job for good, and one that long is presumed stuck. Yields the holder's name."""
    holder = new_holder()
    other = store.claim_launch(job_id, attempt, holder, lease_s=lease_s)
    if other is not None:
        raise LaunchClaimed(job_id, attempt, other, lease_s)
    done = threading.Event()
    hold_s = 10 * lease_s if max_hold_s is None else max_hold_s
    give_up = time.monotonic() + hold_s

    def renew() -> None:
        while not done.wait(lease_s / 3):
            if time.monotonic() >= give_up:
                log.warning(
                    "job %s attempt %d: still launching after %.0f s; the launch claim is "
                    "left to lapse, so another launcher may take the job over",
                    job_id, attempt, hold_s,
                )  # fmt: skip
                return
            try:
                if store.claim_launch(job_id, attempt, holder, lease_s=lease_s) is not None:
                    return  # taken over: this launcher was presumed dead; its launch will fail
            except JobStateError:  # started, ended or requeued: nothing left to claim
                return
            except Exception:  # the store away for a moment: renew at the next turn
                continue

    renewer = threading.Thread(target=renew, name=f"launch-claim-{job_id}", daemon=True)
    renewer.start()
    try:
        yield holder
    finally:
        done.set()
        renewer.join()
