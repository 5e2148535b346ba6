"""Runtimes: where an admitted gang's replicas actually run.

`base` holds the interface every runtime implements and the data it returns; `local` runs
replicas as processes on this machine (the embedded default); `inventory` finds this
machine's GPUs. `kubernetes/` (so far: the cluster's inventory from its nodes and pods) is the
only subpackage allowed to import the kubernetes client; importing this package does not load
it.
"""

from berth.runtime.base import (
    RUNTIME_ENV,
    GangStatus,
    Launch,
    LaunchError,
    LogCursor,
    ReplicaHandle,
    ReplicaStatus,
    Runtime,
    RuntimeUnavailable,
)
from berth.runtime.local import LocalLaunch, LocalReplica, LocalRuntime

__all__ = [
    "RUNTIME_ENV",
    "GangStatus",
    "Launch",
    "LaunchError",
    "LocalLaunch",
    "LocalReplica",
    "LocalRuntime",
    "LogCursor",
    "ReplicaHandle",
    "ReplicaStatus",
    "Runtime",
    "RuntimeUnavailable",
]
