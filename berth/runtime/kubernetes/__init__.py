"""The Kubernetes runtime: Berth's replicas as pods on a real cluster.

The only package of Berth that imports the kubernetes client. `inventory` discovers the nodes
Berth may place on, their topology, and what pods that Berth did not create already hold;
`labels` says which node labels, annotation and taints it reads; `pod_requests` tells what a
pod holds on its node; `runtime` runs admitted gangs as pods (`pods` builds their manifests,
`status` reads their fate).
"""

from berth.runtime.kubernetes.inventory import (
    BERTH,
    MANAGED_BY,
    Inventory,
    discover_cluster,
)
from berth.runtime.kubernetes.labels import (
    DEFAULT_TOLERATIONS,
    GpuGroupsError,
    Toleration,
    TopologyLabels,
    parse_gpu_groups,
)
from berth.runtime.kubernetes.pod_requests import pod_request
from berth.runtime.kubernetes.pods import KubeLaunch, KubeReplica, KubeSettings
from berth.runtime.kubernetes.runtime import KubernetesRuntime, LogsUnavailable
from berth.runtime.kubernetes.status import KubeGangStatus, KubeReplicaStatus

__all__ = [
    "BERTH",
    "DEFAULT_TOLERATIONS",
    "MANAGED_BY",
    "GpuGroupsError",
    "Inventory",
    "KubeGangStatus",
    "KubeLaunch",
    "KubeReplica",
    "KubeReplicaStatus",
    "KubeSettings",
    "KubernetesRuntime",
    "LogsUnavailable",
    "Toleration",
    "TopologyLabels",
    "discover_cluster",
    "parse_gpu_groups",
    "pod_request",
]
