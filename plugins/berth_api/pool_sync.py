"""Team pools kept in step with the teams file, from inside Airflow's API server.

`berth pools sync` does it over the REST API, by hand. Here the plugin does it on its own:
once when the API server builds Berth's app, and again whenever the teams or cluster file
changes (a daemon thread looks every `BERTH_POOL_SYNC_S` seconds, 30 by default; `0` turns it
off), through Airflow's own models, as the Pools page does. Each API server worker may run one:
the writes are upserts of the same values. The files are read afresh each time (the settings
cache them per process). Pools of teams that left the file are kept (tasks may still sit in
them); only `berth-*` pools are touched. The pools' sizes, and why deferred tasks do not
count: berth/pools.py.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from berth.pools import PoolSpec, team_pools
from berth.settings import BerthSettings, settings
from scheduling.config import load_cluster, load_teams

log = logging.getLogger(__name__)
CHECK_EVERY_S = 30.0  # BERTH_POOL_SYNC_S's default


def sync_pools(pools: list[PoolSpec]) -> dict[str, str]:
    """Create or update each pool in Airflow's database: {pool: created | updated | unchanged}."""
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session
    from sqlalchemy import select

    done = {}
    with create_session() as session:
        for spec in pools:
            have = session.scalar(select(Pool).where(Pool.pool == spec.name))
            wanted = (spec.slots, spec.description, False)  # see berth/pools.py: no deferred
            if have is not None and (have.slots, have.description, have.include_deferred) == wanted:
                done[spec.name] = "unchanged"
                continue
            Pool.create_or_update_pool(spec.name, *wanted, session=session)
            done[spec.name] = "created" if have is None else "updated"
    return done


def _signature(s: BerthSettings) -> tuple[tuple[str, float], ...]:
    """What the pools depend on: the teams and cluster files' modification times."""
    paths = [p for p in (s.teams_path, s.cluster_path) if p is not None]
    return tuple((str(p), _mtime(p)) for p in paths)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return -1.0


def sync_once(s: BerthSettings) -> dict[str, str]:
    cluster = load_cluster(s.cluster_path) if s.cluster_path is not None else s.cluster()
    done = sync_pools(team_pools(load_teams(s.teams_path), cluster))
    changed = {k: v for k, v in done.items() if v != "unchanged"}
    if changed:
        log.info("berth team pools synced from %s: %s", s.teams_path, changed)
    return done


def _keep_in_step(s: BerthSettings, every_s: float, stop: threading.Event) -> None:
    seen: tuple[tuple[str, float], ...] | None = None
    while not stop.is_set():
        now = _signature(s)
        if now != seen:
            try:
                sync_once(s)
                seen = now
            except Exception:  # a bad teams file mid-edit, the database away: try again later
                log.exception("berth team pools: sync failed; trying again in %g s", every_s)
        stop.wait(every_s)


def sync_interval() -> float:
    """BERTH_POOL_SYNC_S as seconds (0: off); a bad value is an error naming the variable."""
    raw = os.environ.get("BERTH_POOL_SYNC_S", "").strip()
    try:
        every = float(raw) if raw else CHECK_EVERY_S
    except ValueError:
        every = -1.0
    if not every >= 0:
        raise ValueError(
            f"BERTH_POOL_SYNC_S: must be seconds >= 0 (0 turns the pool sync off), got {raw!r}"
        )
    return every


_started: list[threading.Event] = []


def start_pool_sync() -> None:
    """Start the daemon thread once per process (a no-op after the first call)."""
    if _started:
        return
    stop = threading.Event()
    _started.append(stop)
    every = sync_interval()
    if every == 0:
        log.info("berth team pools: BERTH_POOL_SYNC_S=0, left to `berth pools sync`")
        return
    args = (settings(), every, stop)
    threading.Thread(target=_keep_in_step, args=args, name="berth-pool-sync", daemon=True).start()
