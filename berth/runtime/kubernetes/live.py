"""The store's cluster on Kubernetes: discovered from the nodes, not declared.

`LiveCluster` is what `Store(live=...)` calls before every submission and cycle: the cluster
that `discover_cluster` builds from the nodes (GPUs, model, topology labels, NVLink groups;
NotReady, cordoned and untolerated-taint nodes left out) and the requests that other workloads'
pods hold on them, which the store takes off the free capacity. A discovery lists every node
and every bound pod, so its answer is kept for `ttl_s` (10 s): a cycle every 0.2 s must not
list the cluster each time, and a node that changes is seen within that long.

When the API server cannot be reached, the last answer stands (with a warning) rather than
stopping every cycle: nodes do not vanish because the API server restarts. With no answer yet,
the error goes to the caller, naming the server it tried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from berth.runtime.kubernetes.inventory import Inventory, discover_cluster
from berth.runtime.kubernetes.labels import DEFAULT_TOLERATIONS, Toleration, TopologyLabels
from berth.store import ClusterView

log = logging.getLogger(__name__)


class DiscoveryError(RuntimeError):
    """The cluster could not be discovered and there is no earlier answer to fall back on."""


class LiveCluster:
    """A cached `discover_cluster`, as a `Store`'s live cluster source (see the module doc)."""

    def __init__(
        self,
        api: client.ApiClient,
        labels: TopologyLabels | None = None,
        *,
        tolerations: Sequence[Toleration] = DEFAULT_TOLERATIONS,
        node_selector: str | None = None,
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_s >= 0:
            raise ValueError(f"ttl_s: must be >= 0 seconds, got {ttl_s!r}")
        self.core = client.CoreV1Api(api)
        self.labels = labels or TopologyLabels()
        self.tolerations = tuple(tolerations)
        self.node_selector = node_selector
        self.ttl_s = ttl_s
        self.clock = clock
        self.inventory: Inventory | None = None  # the last discovery (left_out says why not)
        self._view: ClusterView | None = None
        self._at = -float("inf")
        self._lock = threading.Lock()  # the store is called from several threads

    def __call__(self) -> ClusterView:
        with self._lock:
            if self._view is None or self.clock() - self._at >= self.ttl_s:
                self._refresh()
            assert self._view is not None
            return self._view

    def _refresh(self) -> None:
        try:
            inv = discover_cluster(
                self.core,
                self.labels,
                tolerations=self.tolerations,
                node_selector=self.node_selector,
            )
        except (ApiException, HTTPError, OSError) as e:
            host = self.core.api_client.configuration.host
            if self._view is None:
                raise DiscoveryError(
                    f"cannot discover the cluster from the Kubernetes API at {host}: {e}; check "
                    "KUBECONFIG or the pod's ServiceAccount (it needs nodes list and pods list)"
                ) from e
            log.warning("cluster discovery failed (%s); keeping the last one", e)
            self._at = self.clock()
            return
        before = self.inventory.left_out if self.inventory is not None else {}
        for name, why in inv.left_out.items():
            if before.get(name) != why:
                log.warning("node %s is not used by Berth: %s", name, why)
        for name in before.keys() - inv.left_out.keys():
            log.info("node %s is back in Berth's cluster", name)
        self.inventory = inv
        self._view = ClusterView(inv.cluster, inv.foreign, inv.foreign_mig)
        self._at = self.clock()
