"""The engine's SQL store: durable, shared state for many concurrent pollers (store.py)."""

from berth.store.database import StoreURLError
from berth.store.schema import LIVE, OUTCOMES, STATES, TERMINAL
from berth.store.store import DEFAULT_LEASE_S, ClusterView, Store
from berth.store.views import (
    CycleReport,
    DuplicateJobError,
    Event,
    JobStateError,
    JobStatus,
    PlacedReplica,
    StaleAttemptError,
    StoreError,
    TeamUsage,
    UnknownJobError,
    UnsupportedPolicyError,
)

__all__ = [
    "DEFAULT_LEASE_S",
    "LIVE",
    "OUTCOMES",
    "STATES",
    "TERMINAL",
    "ClusterView",
    "CycleReport",
    "DuplicateJobError",
    "Event",
    "JobStateError",
    "JobStatus",
    "PlacedReplica",
    "StaleAttemptError",
    "Store",
    "StoreError",
    "StoreURLError",
    "TeamUsage",
    "UnknownJobError",
    "UnsupportedPolicyError",
]
