"""Runtimes: where an admitted gang's replicas actually run.

`base` holds the interface every runtime implements and the data it returns; `local` runs
replicas as processes on this machine (the embedded default); `inventory` finds this
machine's GPUs. A Kubernetes runtime will sit beside `local`, the only module allowed to import
the kubernetes client.
"""

from scheduling.runtime.base import (
    RUNTIME_ENV,
    GangStatus,
    Launch,
    LaunchError,
    LogCursor,
    ReplicaHandle,
    ReplicaStatus,
    Runtime,
)
from scheduling.runtime.local import LocalLaunch, LocalReplica, LocalRuntime

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
]
