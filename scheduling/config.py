"""cluster.yaml and teams.yaml: validated once here (pydantic), trusted by the engine after.

Errors name the file, the field and the fix; `ConfigError` carries them all at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scheduling.cluster import (
    BLOCK,
    CLUSTER,
    GPU_GROUP,
    LEVELS_ABOVE_NODE,
    NODE,
    RACK,
    Cluster,
    Node,
)
from scheduling.cohorts import Cohort
from scheduling.mig import partitions, profile_problem
from scheduling.quota import MIG_KEY, ModelQuota, Team, quota_key
from scheduling.resources import UNLIMITED, ZERO, Resources

DEFAULT_SLOWDOWN = {GPU_GROUP: 1.0, NODE: 1.1, RACK: 1.3, BLOCK: 1.5, CLUSTER: 1.8}


class ConfigError(ValueError):
    """A configuration file is malformed; the message lists every problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PositiveInt = Annotated[int, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]


class NodePoolSpec(_Strict):
    prefix: str = Field(min_length=1)
    count: PositiveInt
    gpus: Annotated[int, Field(ge=0, le=64)]
    gpu_model: str = "gpu"
    gpu_groups: int | list[list[int]] = 1
    cpus: NonNegative = 0
    memory_gb: NonNegative = 0
    mig: dict[int, list[str]] = Field(default_factory=dict)  # GPU index -> its MIG profiles
    nodes_per_rack: PositiveInt | None = None
    racks_per_block: PositiveInt | None = None


class NodeSpec(_Strict):
    name: str = Field(min_length=1)
    gpus: Annotated[int, Field(ge=0, le=64)]
    gpu_model: str = "gpu"
    gpu_groups: int | list[list[int]] = 1
    cpus: NonNegative = 0
    memory_gb: NonNegative = 0
    mig: dict[int, list[str]] = Field(default_factory=dict)  # GPU index -> its MIG profiles
    labels: dict[str, str] = Field(default_factory=dict)


class ClusterSpec(_Strict):
    name: str = "cluster"
    topology_levels: list[str] = Field(default_factory=list)
    slowdown: dict[str, Annotated[float, Field(ge=1.0)]] = Field(default_factory=dict)
    # GPU model -> speed against the reference model (1.0, the default for a model left out).
    gpu_speed: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict
    )
    node_pools: list[NodePoolSpec] = Field(default_factory=list)
    nodes: list[NodeSpec] = Field(default_factory=list)

    @field_validator("topology_levels")
    @classmethod
    def _levels(cls, v: list[str]) -> list[str]:
        bad = [x for x in v if x not in LEVELS_ABOVE_NODE]
        if bad:
            raise ValueError(f"unknown level(s) {bad}; use a subset of {list(LEVELS_ABOVE_NODE)}")
        if v != [level for level in LEVELS_ABOVE_NODE if level in v]:
            raise ValueError("levels must be distinct and outermost first, e.g. [block, rack]")
        return v

    @field_validator("slowdown")
    @classmethod
    def _slowdown_keys(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k in v if k not in DEFAULT_SLOWDOWN]
        if bad:
            raise ValueError(f"unknown level(s) {bad}; use {list(DEFAULT_SLOWDOWN)}")
        return v

    @model_validator(mode="after")
    def _some_nodes(self) -> ClusterSpec:
        if not self.node_pools and not self.nodes:
            raise ValueError("declare at least one node: add `node_pools:` or `nodes:`")
        return self


MODEL_KEY = "gpus."  # `gpus.<MODEL>`: a team's quota of one GPU model


class QuotaMap(BaseModel):
    """`gpus`, `cpus`, `memory_gb`, `gpus.<MODEL>` keys (one GPU model's quota) and
    `mig.<profile>` keys (one MIG profile's instances)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    gpus: NonNegative | None = None
    cpus: NonNegative | None = None
    memory_gb: NonNegative | None = None

    @model_validator(mode="after")
    def _model_keys(self) -> QuotaMap:
        for key, value in (self.model_extra or {}).items():
            if key.startswith(MIG_KEY):
                problem = profile_problem(key[len(MIG_KEY) :])
                if problem:
                    raise ValueError(f"{key}: {problem}")
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{key}: {value!r} is not a whole number of instances >= 0")
                continue
            model = key[len(MODEL_KEY) :] if key.startswith(MODEL_KEY) else ""
            if not model or "|" in model or model.strip() != model:
                raise ValueError(
                    f"unknown key {key!r}: use gpus, cpus, memory_gb, gpus.<MODEL> for one GPU "
                    "model's quota (e.g. gpus.H100: 8) or mig.<profile> for one MIG profile's "
                    "instances (e.g. mig.1g.10gb: 7)"
                )
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 <= value < math.inf
            ):
                raise ValueError(f"{key}: {value!r} is not a number of GPUs >= 0")
        return self

    def models(self) -> dict[str, float]:
        """The per-model keys: model -> GPUs for `gpus.<MODEL>`, and `mig.<profile>` ->
        instances (a MIG profile's quota is held as a model of that name: `quota_key`)."""
        return {
            k if k.startswith(MIG_KEY) else k[len(MODEL_KEY) :]: float(v)
            for k, v in (self.model_extra or {}).items()
        }


_NAME = r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"


class TeamSpec(_Strict):
    name: str = Field(min_length=1, pattern=_NAME)
    nominal: QuotaMap
    borrowing_limit: QuotaMap | None = None
    lending_limit: QuotaMap | None = None
    weight: Annotated[float, Field(gt=0)] = 1.0
    cohort: str | None = None  # its cohort in the organization tree (None: the root's child)


class CohortSpec(_Strict):
    """A node of the organization tree: a department or group of teams (Kueue's
    hierarchical cohorts). Its maps take `gpus`, `cpus` and `memory_gb` only."""

    name: str = Field(min_length=1, pattern=_NAME)
    parent: str | None = None
    nominal: QuotaMap | None = None  # its own quota, beside what its children lend it
    borrowing_limit: QuotaMap | None = None
    lending_limit: QuotaMap | None = None
    weight: Annotated[float, Field(gt=0)] = 1.0  # fair share against its siblings

    @model_validator(mode="after")
    def _no_model_keys(self) -> CohortSpec:
        for field_name in ("nominal", "borrowing_limit", "lending_limit"):
            q = getattr(self, field_name)
            if q is not None and q.models():
                keys = ", ".join(quota_key(m) for m in q.models())
                raise ValueError(
                    f"{field_name}: per-model keys ({keys}) are a team's, not a cohort's; "
                    "put them on the teams, or use gpus"
                )
        return self


class TeamsSpec(_Strict):
    teams: list[TeamSpec] = Field(min_length=1)
    cohorts: list[CohortSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> TeamsSpec:
        names = [t.name for t in self.teams]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"team names must be unique; repeated: {dup}")
        _check_tree(self)
        return self


def _check_tree(spec: TeamsSpec) -> None:
    """Cohort names unique and apart from the teams', parents and teams' cohorts known, no
    cycle, and a team somewhere under every cohort (else its quota would sit unused)."""
    cohorts = {c.name: c for c in spec.cohorts}
    names = [c.name for c in spec.cohorts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"cohort names must be unique; repeated: {dup}")
    clash = sorted(set(names) & {t.name for t in spec.teams})
    if clash:
        raise ValueError(f"a cohort and a team share the name {clash[0]!r}; rename one")
    for c in spec.cohorts:
        if c.parent is not None and c.parent not in cohorts:
            raise ValueError(
                f"cohort {c.name}: parent {c.parent!r} is not a cohort; declare it under "
                f"cohorts, or leave parent out (a top-level cohort)"
            )
    for t in spec.teams:
        if t.cohort is not None and t.cohort not in cohorts:
            known = ", ".join(sorted(cohorts)) or "none declared"
            raise ValueError(
                f"team {t.name}: cohort {t.cohort!r} is not declared under cohorts "
                f"({known}); declare it, or leave cohort out"
            )
    for c in spec.cohorts:
        seen, at = [c.name], c
        while at.parent is not None:
            at = cohorts[at.parent]
            if at.name in seen:
                loop = " -> ".join([*seen[seen.index(at.name) :], at.name])
                raise ValueError(f"cohorts form a cycle: {loop}; one of them needs no parent")
            seen.append(at.name)
    used: set[str] = set()
    for t in spec.teams:
        at = cohorts.get(t.cohort) if t.cohort else None
        while at is not None and at.name not in used:
            used.add(at.name)
            at = cohorts.get(at.parent) if at.parent else None
    empty = sorted(set(cohorts) - used)
    if empty:
        raise ValueError(
            f"cohort {empty[0]} has no team under it; give a team `cohort: {empty[0]}` (or "
            "one of its sub-cohorts), or remove it"
        )


def _mig(spec: NodePoolSpec | NodeSpec, where: str) -> tuple[tuple[int, str], ...]:
    try:
        return partitions(spec.mig, spec.gpus, f"{where}.mig")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _groups(spec: NodePoolSpec | NodeSpec, where: str) -> tuple[int, ...]:
    if spec.gpus == 0:
        return ()
    if isinstance(spec.gpu_groups, int):
        n = spec.gpu_groups
        if n < 1 or spec.gpus % n:
            raise ConfigError(
                f"{where}.gpu_groups: {n} groups cannot split {spec.gpus} GPUs evenly; "
                "give a divisor of gpus or explicit lists of GPU indices"
            )
        size = spec.gpus // n
        return tuple(((1 << size) - 1) << (i * size) for i in range(n))
    seen: list[int] = [i for g in spec.gpu_groups for i in g]
    if sorted(seen) != list(range(spec.gpus)):
        raise ConfigError(
            f"{where}.gpu_groups: every GPU index 0..{spec.gpus - 1} must be in exactly one "
            f"group; got {spec.gpu_groups}"
        )
    return tuple(sum(1 << i for i in g) for g in spec.gpu_groups)


def build_cluster(spec: ClusterSpec) -> Cluster:
    """Expand node pools and explicit nodes into a `Cluster`."""
    levels = tuple(spec.topology_levels)
    nodes: list[Node] = []
    for p_i, pool in enumerate(spec.node_pools):
        groups = _groups(pool, f"node_pools[{p_i}]")
        mig = _mig(pool, f"node_pools[{p_i}]")
        per_rack = pool.nodes_per_rack or pool.count
        per_block = per_rack * (pool.racks_per_block or max(1, -(-pool.count // per_rack)))
        for k in range(pool.count):
            doms = []
            for level in levels:
                if level == "block":
                    doms.append(f"{pool.prefix}-block{k // per_block}")
                else:
                    doms.append(f"{pool.prefix}-rack{k // per_rack}")
            nodes.append(
                _node(len(nodes), f"{pool.prefix}-{k:03d}", pool, groups, tuple(doms), mig=mig)
            )
    for n_i, ns in enumerate(spec.nodes):
        groups = _groups(ns, f"nodes[{n_i}]")
        missing = [lv for lv in levels if lv not in ns.labels]
        if missing:
            raise ConfigError(
                f"nodes[{n_i}] ({ns.name}).labels: missing {missing}; every node needs a label "
                f"for each topology level {list(levels)}"
            )
        doms = tuple(f"{ns.labels[lv]}" for lv in levels)
        mig = _mig(ns, f"nodes[{n_i}]")
        nodes.append(_node(len(nodes), ns.name, ns, groups, doms, ns.labels, mig))
    names = [n.name for n in nodes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"node names must be unique; repeated: {dup}")
    slowdown = {**DEFAULT_SLOWDOWN, **spec.slowdown}
    models = sorted({n.gpu_model for n in nodes})
    unknown = sorted(set(spec.gpu_speed) - set(models))
    if unknown:
        raise ConfigError(
            f"gpu_speed: {unknown} is no node's gpu_model; the nodes have {models} (a speed is "
            "per model, e.g. gpu_speed: {H100: 3.0, A100: 1.0})"
        )
    return Cluster(spec.name, levels, tuple(nodes), slowdown, dict(spec.gpu_speed))


def _node(
    index: int,
    name: str,
    spec: Any,
    groups: tuple[int, ...],
    doms: tuple[str, ...],
    labels: dict[str, str] | None = None,
    mig: tuple[tuple[int, str], ...] = (),
) -> Node:
    r = Resources.of(0, spec.cpus, spec.memory_gb)
    return Node(
        index, name, spec.gpus, spec.gpu_model, groups, r.cpu, r.mem, doms, labels or {}, mig
    )


def _limit(q: QuotaMap | None, default: Resources) -> Resources:
    if q is None:
        return default
    d = Resources.of(q.gpus or 0, q.cpus or 0, q.memory_gb or 0)
    return Resources(
        default.gpu if q.gpus is None else d.gpu,
        default.cpu if q.cpus is None else d.cpu,
        default.mem if q.memory_gb is None else d.mem,
    )


def build_teams(spec: TeamsSpec) -> dict[str, Team]:
    """Teams by name. An unset nominal resource is not limited by quota."""
    out: dict[str, Team] = {}
    unlimited = Resources(UNLIMITED, UNLIMITED, UNLIMITED)
    for t in spec.teams:
        nominal = _limit(t.nominal, unlimited)
        borrowing = _limit(t.borrowing_limit, unlimited)
        lending = _limit(t.lending_limit, nominal)
        excess = lending.first_excess(nominal)
        if excess:
            raise ConfigError(
                f"team {t.name}: lending_limit.{excess} exceeds its nominal; lend at most nominal"
            )
        models = _model_quotas(t)
        out[t.name] = Team(t.name, nominal, borrowing, lending.clamp_low(), t.weight, models)
    if not spec.cohorts:
        return out
    cohorts = _build_cohorts(spec, out)
    for t in spec.teams:
        path: list[Cohort] = []
        name = t.cohort
        while name is not None:
            path.append(cohorts[name])
            name = cohorts[name].parent
        out[t.name] = replace(out[t.name], cohorts=tuple(path))
    return out


def _build_cohorts(spec: TeamsSpec, teams: Mapping[str, Team]) -> dict[str, Cohort]:
    """Each cohort with its quota: its own nominal plus what its teams and sub-cohorts lend
    it, worked out from the leaves up."""
    by_name = {c.name: c for c in spec.cohorts}
    depth = {}
    for c in spec.cohorts:
        d, at = 0, c
        while at.parent is not None:
            at, d = by_name[at.parent], d + 1
        depth[c.name] = d
    lent: dict[str, Resources] = {}  # cohort -> what its children lend it
    for t in spec.teams:
        if t.cohort is not None:
            lent[t.cohort] = lent.get(t.cohort, ZERO) + teams[t.name].lends
    out: dict[str, Cohort] = {}
    unlimited = Resources(UNLIMITED, UNLIMITED, UNLIMITED)
    for c in sorted(spec.cohorts, key=lambda c: -depth[c.name]):  # the deepest first
        nominal = _limit(c.nominal, ZERO)
        raw = nominal + lent.get(c.name, ZERO)
        quota = Resources(min(raw.gpu, UNLIMITED), min(raw.cpu, UNLIMITED), min(raw.mem, UNLIMITED))
        lending = None if c.lending_limit is None else _limit(c.lending_limit, quota)
        cohort = Cohort(
            c.name,
            c.parent,
            nominal,
            _limit(c.borrowing_limit, unlimited),
            lending,
            quota,
            c.weight,
        )
        out[c.name] = cohort
        if c.parent is not None:
            lent[c.parent] = lent.get(c.parent, ZERO) + cohort.lends
    return out


def _model_quotas(t: TeamSpec) -> tuple[ModelQuota, ...]:
    """The team's `gpus.<MODEL>` keys as per-model quotas. A model named in any of the three
    maps is enforced; its nominal is 0 where only a limit names it (as a Kueue flavor with no
    nominal quota: the team may use it only by borrowing, within the borrowing limit)."""
    maps = {
        "nominal": t.nominal.models(),
        "borrowing_limit": t.borrowing_limit.models() if t.borrowing_limit else {},
        "lending_limit": t.lending_limit.models() if t.lending_limit else {},
    }
    out = []
    for model in sorted({m for keys in maps.values() for m in keys}):
        nominal = Resources.of(maps["nominal"].get(model, 0)).gpu
        borrowing = maps["borrowing_limit"].get(model)
        lending = maps["lending_limit"].get(model)
        q = ModelQuota(
            model,
            nominal,
            UNLIMITED if borrowing is None else Resources.of(borrowing).gpu,
            None if lending is None else Resources.of(lending).gpu,
        )
        if q.lends > nominal:
            key = quota_key(model)
            raise ConfigError(
                f"team {t.name}: lending_limit.{key} exceeds its nominal {key} "
                f"({nominal / 1000:g}); lend at most nominal"
            )
        out.append(q)
    return tuple(out)


def read_yaml(path: Path) -> Any:
    """The YAML at `path`; ConfigError when it is missing or malformed."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def explain(path: Path, err: ValidationError) -> ConfigError:
    """Every problem of `err`, one line each, with its field path under `path`."""
    lines = [f"{path}: {len(err.errors())} problem(s)"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        lines.append(f"  {loc}: {e['msg']}")
    return ConfigError("\n".join(lines))


def parse_cluster(data: Any, source: str = "cluster.yaml") -> Cluster:
    try:
        return build_cluster(ClusterSpec.model_validate(data))
    except ValidationError as e:
        raise explain(Path(source), e) from None


def parse_teams(data: Any, source: str = "teams.yaml") -> dict[str, Team]:
    if isinstance(data, list):
        data = {"teams": data}
    try:
        return build_teams(TeamsSpec.model_validate(data))
    except ValidationError as e:
        raise explain(Path(source), e) from None


def load_cluster(path: Path) -> Cluster:
    """Read and validate a cluster.yaml."""
    return parse_cluster(read_yaml(path), str(path))


def load_teams(path: Path) -> dict[str, Team]:
    """Read and validate a teams.yaml (a list of teams, or a mapping with `teams:`)."""
    return parse_teams(read_yaml(path), str(path))
