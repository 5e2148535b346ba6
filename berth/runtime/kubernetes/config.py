"""BERTH_KUBE_SETTINGS: one YAML that says how Berth uses a Kubernetes cluster.

Every section is optional; an absent file or section means the defaults (pods.KubeSettings,
labels.TopologyLabels). The same file serves the runtime (how pods look, the data volume, DRA)
and discovery (which labels give the topology, which nodes are Berth's), so the store's view of
the cluster and the pods it launches agree on tolerations and the GPU resource:

```yaml
pods:                      # berth/runtime/kubernetes/pods.py KubeSettings
  namespace_template: "ml-{team}"
  data_volume: {claim: berth-data, staging_image: registry.example/berth-airflow:0.1.0}
topology:                  # labels.TopologyLabels
  rack: topology.kubernetes.io/zone
  gpu_models: {NVIDIA-H100-80GB-HBM3: H100}   # GPU feature discovery's product -> model
  gpu_speed: {H100: 2.0}
node_selector: berth.io/pool=training
discovery_ttl_s: 10
watch: true                # polls read a list-and-watch of pods, Services, nodes (watch.py)
```
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from berth.runtime.kubernetes.labels import TopologyLabels
from berth.runtime.kubernetes.pods import KubeSettings
from scheduling.config import ConfigError, explain, read_yaml


class KubeConfig(BaseModel):
    """The file's contents; see the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pods: KubeSettings = Field(default_factory=KubeSettings)
    topology: TopologyLabels = Field(default_factory=TopologyLabels)
    node_selector: str | None = None  # a label selector: only these nodes are Berth's
    discovery_ttl_s: float = Field(10.0, ge=0)  # how long one read of the nodes is reused
    # One list-and-watch per process of Berth's pods and Services and the nodes, which polls
    # read (watch.py, decision 0020); false: every poll asks the API server.
    watch: bool = True

    @model_validator(mode="after")
    def _one_gpu_resource(self) -> KubeConfig:
        # Discovery counts one resource and the pods request one: they must be the same.
        if self.pods.gpu_resource != self.topology.gpu_resource:
            raise ValueError(
                f"pods.gpu_resource ({self.pods.gpu_resource}) and topology.gpu_resource "
                f"({self.topology.gpu_resource}) differ; set both to the resource your GPU "
                "device plugin advertises"
            )
        return self


def load_kube_config(path: Path | None) -> KubeConfig:
    """The file at `path` (None: every default). ConfigError names the file and each field."""
    if path is None:
        return KubeConfig()
    data = read_yaml(path)
    try:
        return KubeConfig.model_validate(data or {})
    except ValidationError as e:
        raise explain(path, e) from None


__all__ = ["ConfigError", "KubeConfig", "load_kube_config"]
