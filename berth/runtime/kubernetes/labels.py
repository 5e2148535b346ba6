"""What Berth reads off Kubernetes nodes: which labels carry the topology, which annotation the
GPU groups, and which taints Berth's pods tolerate. Validated once here (pydantic); the
discovery in `inventory` trusts it.

Defaults follow what GPU clusters already carry: NVIDIA's GPU feature discovery labels the GPU
model as `nvidia.com/gpu.product`, the device plugin advertises `nvidia.com/gpu`, and managed
GPU node pools taint their nodes `nvidia.com/gpu` so that only pods asking for GPUs land there.
The block and rack labels are Berth's own (`berth.io/block`, `berth.io/rack`); a cluster that
already has them under other keys (say `topology.kubernetes.io/zone` for blocks) names those.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED = re.compile(rf"({_PREFIX}/)?{_NAME}")
_EFFECTS_THAT_REPEL = ("NoSchedule", "NoExecute")  # PreferNoSchedule only prefers


class GpuGroupsError(ValueError):
    """A node's GPU-groups annotation or label cannot be read; the message says the fix."""


def _label_key(value: str) -> str:
    prefix, _, _ = value.rpartition("/")
    if not _QUALIFIED.fullmatch(value) or len(prefix) > 253:
        raise ValueError(
            f"{value!r} is not a Kubernetes label key; use a name such as 'berth.io/rack' or "
            "'topology.kubernetes.io/zone' (optional DNS prefix and '/', then at most 63 "
            "letters, digits, '-', '_' or '.', starting and ending with a letter or digit)"
        )
    return value


LabelKey = Annotated[str, AfterValidator(_label_key)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TopologyLabels(_Strict):
    """Where a node's place in the topology and its GPUs are written.

    `block` and `rack` name the labels of the two levels above node (None: the cluster has no
    such level). `gpu_groups` is read from the node's annotations first, then its labels: an
    annotation is what a discovery agent or an admin sets, and only an annotation may hold the
    natural '0,1,2,3;4,5,6,7' (label values cannot hold ',' or ';').
    """

    block: LabelKey | None = "berth.io/block"
    rack: LabelKey | None = "berth.io/rack"
    gpu_groups: LabelKey = "berth.io/gpu-groups"
    gpu_product: LabelKey = "nvidia.com/gpu.product"
    gpu_memory: LabelKey = "nvidia.com/gpu.memory"  # MiB per GPU, as feature discovery says
    gpu_resource: LabelKey = "nvidia.com/gpu"
    # The admin's table from GPU feature discovery's product names to the model names that
    # teams' `gpus.<MODEL>` keys and jobs' `gpu_model` use, e.g. {NVIDIA-H100-80GB-HBM3: H100};
    # a product not in it is its own model name. Several products may map to one model (the
    # PCIe and SXM cards of a generation, when the admin wants them as one). A key
    # `<product>@<MiB>` names a product with that much memory per GPU (the memory label), for
    # products whose name does not tell their memory sizes apart, e.g.
    # {Tesla-V100-PCIE@16384: V100-16, Tesla-V100-PCIE@32768: V100-32}; it wins over the
    # product's own key.
    gpu_models: dict[str, str] = {}
    # Model (after the table) -> speed against 1.0, as cluster.yaml's gpu_speed.
    gpu_speed: dict[str, Annotated[float, Field(gt=0)]] = {}

    @field_validator("gpu_models")
    @classmethod
    def _model_names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = sorted(m for m in v.values() if not m or "|" in m or m.strip() != m)
        if bad:
            raise ValueError(
                f"model names {bad} cannot be used: give names without '|' or surrounding "
                "spaces, such as H100"
            )
        return v

    def model_of(self, product: str | None, memory: str | None = None) -> str:
        """A node's GPU model from its product and memory labels (`gpu`: no product label):
        the table's `<product>@<memory>` entry, else its product's, else the product."""
        if product is None:
            return "gpu"
        if memory is not None and (named := self.gpu_models.get(f"{product}@{memory}")):
            return named
        return self.gpu_models.get(product, product)

    @property
    def levels(self) -> tuple[tuple[str, str], ...]:
        """(level, label key) for each configured level above node, outermost first."""
        pairs = (("block", self.block), ("rack", self.rack))
        return tuple((level, key) for level, key in pairs if key is not None)


class Toleration(_Strict):
    """A toleration of Berth's pods, with Kubernetes' matching rules (core/v1 Toleration)."""

    key: str = ""
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(
                f"toleration of {self.key!r}: operator Exists takes no value; drop value "
                f"{self.value!r} or use operator Equal"
            )
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists (tolerate all)")
        return self

    def tolerates(self, taint: Any) -> bool:
        """True when this toleration lets a pod onto a node with `taint` (a V1Taint)."""
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == (taint.value or "")

    def to_k8s(self) -> dict[str, str]:
        """As a pod spec's toleration, so that the pods Berth creates carry the same set."""
        out = {"key": self.key, "operator": self.operator, "effect": self.effect}
        if self.operator == "Equal":
            out["value"] = self.value
        return {k: v for k, v in out.items() if v}


# Managed GPU node pools taint their nodes `nvidia.com/gpu` (with value `present` or none) so
# that only GPU pods land there; Berth's pods are GPU pods.
DEFAULT_TOLERATIONS: tuple[Toleration, ...] = (Toleration(key="nvidia.com/gpu", operator="Exists"),)


def repelling_taint(taints: Any, tolerations: tuple[Toleration, ...]) -> Any | None:
    """The first NoSchedule or NoExecute taint that no toleration tolerates, else None."""
    for taint in taints or ():
        if taint.effect in _EFFECTS_THAT_REPEL and not any(t.tolerates(taint) for t in tolerations):
            return taint
    return None


_GROUP_SEPARATORS = re.compile(r"[;_]")
_INDEX_SEPARATORS = re.compile(r"[,.]")
_GROUPS_FIX = (
    "write the groups of GPU indices, e.g. '0,1,2,3;4,5,6,7' in an annotation or "
    "'0.1.2.3_4.5.6.7' in a label, or a number of equal groups such as '2'"
)


def parse_gpu_groups(value: str, gpus: int) -> tuple[int, ...]:
    """GPU groups as bitmasks (one per group) from a node's annotation or label.

    Accepted: '0,1,2,3;4,5,6,7' (annotation), '0.1.2.3_4.5.6.7' (the same in label-safe
    characters), ranges such as '0-3;4-7', or a number N for N equal groups of consecutive GPUs
    (N >= 1, as `gpu_groups: N` in cluster.yaml). Every GPU 0..gpus-1 must be in exactly one group.
    """
    text = value.strip()
    if text.isdigit() and int(text) >= 1:  # '0' is GPU 0 alone (a 1-GPU node), not 0 groups
        n = int(text)
        if gpus % n:
            raise GpuGroupsError(f"{n} equal groups cannot split {gpus} GPUs; {_GROUPS_FIX}")
        size = gpus // n
        return tuple(((1 << size) - 1) << (i * size) for i in range(n))
    groups: list[list[int]] = []
    for part in _GROUP_SEPARATORS.split(text):
        group: list[int] = []
        for item in _INDEX_SEPARATORS.split(part):
            lo, dash, hi = item.strip().partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise GpuGroupsError(f"{item.strip()!r} is not a GPU index; {_GROUPS_FIX}")
            group.extend(range(int(lo), int(hi if dash else lo) + 1))
        groups.append(group)
    seen = sorted(i for g in groups for i in g)
    if seen != list(range(gpus)):
        raise GpuGroupsError(
            f"the groups hold GPUs {seen}, but every GPU 0..{gpus - 1} of the node's {gpus} "
            f"allocatable must be in exactly one group; {_GROUPS_FIX}"
        )
    return tuple(sum(1 << i for i in g) for g in groups)
