"""policy.yaml: an admin's scheduling policy, validated once here (pydantic).

A policy file starts from a named policy (`base`, default `berth`) and sets any of its knobs;
every knob it leaves out keeps the base's value, documented with why in `policy.Policy` and
docs/decisions/0002 and 0003. `berth simulate --policy-file` and the store
(`BERTH_POLICY_FILE`) read the same file, so the policy an admin compared in the simulator is
the one that runs.

    base: berth
    name: berth-patient        # how reports call it (default: <base>-custom)
    ordering: drf              # or drf-smallest-first (scheduling/ordering.py)
    starvation_s: 7200         # blocked this long on placement -> its nodes are reserved
    max_reservations: 2
    easy_backfill: true        # a job with a time_limit_s that ends in time may use reserved nodes
    min_runtime_s: 900         # no preemption of a job younger than this
    preemption_delay_s: 300    # a job waits this long before it may preempt
    max_preemptions: 1         # priority preemption; reclaim only until reclaim_deadline_s
    max_victim_runtime_s: 3600 # priority preemption only
    checkpoint_aware: false    # true: victims by the work lost since their last checkpoint
    victim_keeps_nominal: true # false: Kueue's rule, a reclaim may take a borrowing team below
                               # its nominal (the berth-quick-reclaim policy)
    tree_reclaim: prefer       # strict: Kueue's hierarchical reclaim, only borrowers whose
                               # departments borrow too (never a department within its quota)
    preempts_beyond_nominal: true  # false: Kueue without borrowWithinCohort, a job bigger
                               # than its team's nominal never preempts
    expected_finish_models: false  # true: a job that accepts several GPU models waits for a
                               # faster one where it is expected to finish sooner there
    las_demote_after_gpu_s: .inf   # least attained service: a job that checkpoints goes below
                               # its priority's others after this many GPU-seconds of service
                               # (berth-las-gpu: 14400; docs/decisions/0014)
    las_demote_after_s: .inf       # the same in seconds of run time, whatever the job's size
                               # (berth-las: 14400)
    las_promote_after_x: .inf      # a demoted job that has waited since its preemption this
                               # many times its run time so far goes back up to its priority
                               # (Tiresias's promotion; berth-las-promote: 16; decision 0014)

Team weights for fair sharing live with the quotas, in teams.yaml (`weight`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from scheduling.config import ConfigError, explain, read_yaml
from scheduling.ordering import ORDERINGS
from scheduling.policy import POLICIES, Policy

Seconds = Annotated[float, Field(ge=0)]


class PolicyFile(BaseModel):
    """The knobs an admin may set; `None` keeps the base policy's value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str = "berth"
    name: str | None = Field(default=None, min_length=1, max_length=64)
    ordering: str | None = None
    preemption: bool | None = None
    min_runtime_s: Seconds | None = None
    preemption_delay_s: Seconds | None = None
    max_preemptions: Annotated[int, Field(ge=0)] | None = None
    max_victim_runtime_s: Annotated[float, Field(gt=0)] | None = None
    max_preemption_candidates: Annotated[int, Field(ge=1, le=10_000)] | None = None
    max_preemption_searches_per_team: Annotated[int, Field(ge=0, le=10_000)] | None = None
    reclaim_searches_per_team: Annotated[int, Field(ge=0, le=10_000)] | None = None
    starvation_s: Annotated[float, Field(gt=0)] | None = None  # .inf: no starvation guard
    max_reservations: Annotated[int, Field(ge=0, le=1_000)] | None = None
    easy_backfill: bool | None = None
    reclaim_deadline_s: Seconds | None = None
    checkpoint_aware: bool | None = None
    victim_keeps_nominal: bool | None = None
    tree_reclaim: Literal["prefer", "strict"] | None = None
    preempts_beyond_nominal: bool | None = None
    expected_finish_models: bool | None = None
    las_demote_after_gpu_s: Annotated[float, Field(gt=0)] | None = None  # .inf: off
    las_demote_after_s: Annotated[float, Field(gt=0)] | None = None  # .inf: off
    las_promote_after_x: Annotated[float, Field(ge=0)] | None = None  # .inf: never

    @field_validator("base")
    @classmethod
    def _known_base(cls, v: str, info: ValidationInfo) -> str:
        known = _known(info)
        if v not in known:
            hint = ""
            if known is POLICIES:
                hint = " (the baselines, such as kueue-tas, run only in the simulator)"
            raise ValueError(f"unknown policy {v!r}; start from one of: {', '.join(known)}{hint}")
        return v

    @field_validator("ordering")
    @classmethod
    def _known_ordering(cls, v: str | None) -> str | None:
        if v is not None and v not in ORDERINGS:
            raise ValueError(
                f"unknown ordering {v!r}; choose one of: {', '.join(ORDERINGS)} (the "
                "baselines' orderings run only in the simulator, with their policies)"
            )
        return v

    @field_validator("min_runtime_s", "preemption_delay_s")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(
                "must be a finite number of seconds; to turn preemption off, set "
                "`preemption: false`"
            )
        return v

    def policy(self, known: Mapping[str, Policy] = POLICIES) -> Policy:
        changes: dict[str, Any] = {
            k: v for k, v in self.model_dump(exclude={"base", "name"}).items() if v is not None
        }
        if self.ordering is not None:
            changes["ordering"] = ORDERINGS[self.ordering]
        return replace(known[self.base], name=self.name or f"{self.base}-custom", **changes)


def _known(info: ValidationInfo) -> Mapping[str, Policy]:
    return (info.context or {}).get("policies", POLICIES)


def parse_policy(
    data: Any, source: str = "policy.yaml", known: Mapping[str, Policy] = POLICIES
) -> Policy:
    """A Policy from a policy file's data; ConfigError naming each field and its fix.

    `known`: the policies a file may start from; Berth's own (what the store runs) unless the
    simulator passes its baselines too."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must be a mapping of knobs to values, e.g. `base: berth`")
    try:
        return PolicyFile.model_validate(data, context={"policies": known}).policy(known)
    except ValidationError as e:
        raise explain(Path(source), e) from None


def load_policy(path: Path, known: Mapping[str, Policy] = POLICIES) -> Policy:
    """Read and validate a policy file."""
    return parse_policy(read_yaml(path), str(path), known)
