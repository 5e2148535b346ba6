"""Housekeeping that no job's own tasks do: what a crashed process left behind.

- The store: attempts whose worker went silent past their lease end as lost and requeue
  (`Store.reap`; the cycle pollers do it too, but only while some job waits for admission).
- Kubernetes: pods, Services and ResourceClaims of attempts the store no longer holds as live
  (a launch that died half way, a worker killed mid-teardown, finished attempts past their
  keeping time) are deleted (`KubernetesRuntime.cleanup_orphans`). A finished attempt is kept
  `keep_s` (an hour by default) after its last replica ended, so on-call can still read it.

`dags/berth_maintenance.py` runs `sweep` every ten minutes on Kubernetes (operators.steps'
SweepOperator: in Berth's triggerer there, decision 0030).
"""

from __future__ import annotations

import logging
from typing import Any

from berth.settings import BerthSettings
from berth.store.schema import ADMITTED, PREEMPTING, RUNNING

LIVE = (ADMITTED, RUNNING, PREEMPTING)  # attempts whose pods may exist and must stay
KEEP_S = 3600.0

log = logging.getLogger(__name__)


def sweep(s: BerthSettings, *, keep_s: float = KEEP_S, log: logging.Logger = log) -> dict[str, Any]:
    """Reap the store, then delete orphaned Kubernetes objects; returns what was done."""
    if not keep_s >= 0:
        raise ValueError(f"keep_s: must be >= 0 seconds, got {keep_s!r}")
    store = s.store()
    reaped = store.reap()
    for job_id in reaped:
        log.warning("job %s: its worker went silent; attempt ended as lost and requeued", job_id)
    deleted: list[str] = []
    if s.runtime_kind == "kubernetes":
        from berth.runtime.kubernetes import KubernetesRuntime

        runtime = s.runtime()
        assert isinstance(runtime, KubernetesRuntime)
        # Read the live attempts before listing the cluster: an attempt launched in between
        # has objects younger than keep_s, which cleanup_orphans leaves alone.
        live = {(st.id, st.attempt) for st in store.jobs(states=LIVE)}
        namespaces = sorted({runtime.namespace(team) for team in s.teams()})
        deleted = runtime.cleanup_orphans(live, namespaces, keep_s=keep_s)
        for what in deleted:
            log.info("deleted %s: its attempt is no longer live", what)
    log.info("reaped %d attempt(s); deleted %d orphaned object(s)", len(reaped), len(deleted))
    return {"reaped": reaped, "deleted": deleted}
