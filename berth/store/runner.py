"""Cycles on the engine state kept in memory: catch up, decide, check and write (decision 0013).

A `CycleRunner` is a Store's: it holds the Mirror (mirror.py) and runs one cycle at a time
(the Mirror is shared by the Store's threads). A cycle:

1. catches the Mirror up with what was committed since its version (a snapshot read, no lock),
   or builds it (at start, on a gap, after a cycle run elsewhere, when the cluster changed);
2. decides, and works out every waiting job's reason, with no lock (apply.decide, explain);
3. under the store's lock: reads what was committed meanwhile; decides again if that touched a
   job it decided about (`OPTIMISTIC_TRIES` times at most, then once more under the lock, so a
   cycle always ends), else takes it in, checks and writes (apply.commit).
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, select

from berth.store import etas
from berth.store.apply import commit, conflicts, decide, explain
from berth.store.database import locked, reading, snapshot
from berth.store.lease import Lease
from berth.store.mirror import GapError, Mirror, News
from berth.store.schema import engine_row
from berth.store.views import CycleReport
from scheduling.policy import Policy
from scheduling.run_times import RunTimes
from scheduling.state import EngineState

if TYPE_CHECKING:
    from collections.abc import Mapping

    from berth.store.store import ClusterView
    from scheduling.quota import Team

# Cycles decided outside the lock that found a job they decided about changed meanwhile are
# decided again; after this many, the next is decided under the lock, so a cycle always ends.
OPTIMISTIC_TRIES = 2
# How often a policy that reads run times (`Policy.expected_finish_models`) learns them again
# from the finished attempts: a query per cycle would cost more than the estimate changes.
RUN_TIMES_EVERY_S = 60.0


class CycleRunner:
    """See the module docstring."""

    def __init__(
        self, engine: Engine, teams: Mapping[str, Team], policy: Policy, *, live: bool
    ) -> None:
        self.engine = engine
        self.teams = teams
        self.policy = policy
        self.live = live
        self.mirror: Mirror | None = None
        self.builds = 0  # full builds of the mirror (at start, on a gap, a cluster change)
        self._one_at_a_time = threading.Lock()
        # The mirror caught up past changes no cycle has decided on (a self-check absorbs
        # them to compare): `changed()` must still say so, or the loop would sleep on them.
        self._undecided = False
        self._run_times: tuple[float, RunTimes] | None = None  # (learned at, them)
        self.run_times_every_s = RUN_TIMES_EVERY_S

    def forget(self) -> None:
        """Build the state again before the next cycle (what every cycle did before 0013)."""
        self.mirror = None

    def schedule(self, view: ClusterView, now: float, lease: Lease | None) -> CycleReport:
        """One cycle on `view` at `now` (see the module docstring)."""
        started = time.perf_counter()
        with self._one_at_a_time:
            run_times = self._learned_run_times()
            for tries in range(OPTIMISTIC_TRIES + 1):
                mirror = self._caught_up(view)
                mirror.state.run_times = run_times
                result = explained = None
                if tries < OPTIMISTIC_TRIES:
                    result = decide(mirror, now)
                    explained = explain(mirror, result)
                asked = time.perf_counter()
                with locked(self.engine) as conn:
                    if lease is not None:
                        lease.check(conn)
                    try:
                        news = mirror.news(conn)
                    except GapError:
                        if result is not None:
                            self.mirror = None
                            continue
                        mirror = self._build(conn, view)  # under the lock: it cannot move
                        mirror.state.run_times = run_times
                        news = mirror.news(conn)
                    if result is None or explained is None:  # the last try: under the lock
                        mirror.absorb(news)
                        news = News.none(mirror)
                        result = decide(mirror, now)
                        explained = explain(mirror, result)
                    elif conflicts(mirror, news, result):
                        mirror.absorb(news)
                        continue
                    try:
                        report = commit(conn, mirror, news, result, explained, started, tries + 1)
                    except BaseException:
                        self.mirror = None  # half applied: build it again next time
                        raise
                # Changes committed by others after this cycle decided were taken in by its
                # commit, unseen by its decisions: the next `changed()` must say so.
                self._undecided = bool(news.job_ids)
                # from asking for the lock to the commit's end: what others may wait for
                return replace(report, locked_ms=(time.perf_counter() - asked) * 1000.0)
        raise AssertionError("unreachable: the last try decides under the lock")

    def _learned_run_times(self) -> RunTimes | None:
        """The teams' run times from their finished attempts (wall seconds), where the policy
        reads them; learned again every `run_times_every_s`."""
        if not self.policy.expected_finish_models:
            return None
        now = time.monotonic()
        if self._run_times is None or now - self._run_times[0] >= self.run_times_every_s:
            self._run_times = (now, etas.run_times(self.engine, self.teams))
        return self._run_times[1]

    def forward_state(self, view: ClusterView) -> EngineState:
        """A copy of the engine's state as of the last commit, for a forward run (the ETA):
        the mirror's when it is that (as right after a cycle), else one read from the tables.
        Never by catching the mirror up: `changed()` compares the mirror's version with the
        store's, and a mirror moved on without a cycle would hide changes no cycle saw."""
        with self._one_at_a_time:
            mirror = self.mirror
            if mirror is not None and (
                mirror.cluster is view.cluster or mirror.cluster == view.cluster
            ):
                with reading(self.engine) as conn:
                    version = conn.execute(select(engine_row.c.version)).scalar_one()
                if version == mirror.version and not self._undecided:
                    return mirror.state.clone()
        with snapshot(self.engine) as conn:
            return self._load(conn, view).state

    def changed(self) -> bool:
        """Whether anything was committed since the last cycle (or there was none)."""
        if self.mirror is None or self._undecided:
            return True
        with reading(self.engine) as conn:
            version = conn.execute(select(engine_row.c.version)).scalar_one()
        return version != self.mirror.version

    def self_check(self, view: ClusterView) -> None:
        """Compare the state with one built afresh from the tables (MirrorDiverged)."""
        with self._one_at_a_time:
            before = None if self.mirror is None else self.mirror.version
            mirror = self._caught_up(view)
            with snapshot(self.engine) as conn:
                try:
                    mirror.absorb(mirror.news(conn))
                    if mirror.version != before:
                        self._undecided = True
                except GapError:  # a cycle ran elsewhere: nothing to compare, build it again
                    self.mirror = None
                    return
                fresh = self._load(conn, view)
            mirror.check_against(fresh)

    def _caught_up(self, view: ClusterView) -> Mirror:
        """The mirror of this cluster view, caught up to the last commit (built if needed)."""
        mirror = self.mirror
        if (
            mirror is not None
            and mirror.cluster is not view.cluster
            and mirror.cluster != view.cluster
        ):
            mirror = None
        with snapshot(self.engine) as conn:
            if mirror is not None:
                try:
                    mirror.absorb(mirror.news(conn))
                except GapError:
                    mirror = None
            if mirror is None:
                mirror = self._build(conn, view)
        mirror.set_held(view.held, view.held_mig)
        return mirror

    def _load(self, conn: Connection, view: ClusterView) -> Mirror:
        """A mirror built from the tables, on `view`'s cluster less what others hold there."""
        return Mirror.load(
            conn,
            view.cluster,
            self.teams,
            self.policy,
            held=view.held,
            held_mig=view.held_mig,
            live=self.live,
        )

    def _build(self, conn: Connection, view: ClusterView) -> Mirror:
        # The state lives as long as the process: out of the collector's way once built
        # (gc.freeze), after letting it collect the last one (gc.unfreeze).
        gc.unfreeze()
        self.mirror = None
        mirror = self._load(conn, view)
        gc.freeze()
        self.mirror = mirror
        self.builds += 1
        return mirror
