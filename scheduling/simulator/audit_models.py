"""The audit's per-model quota rule: no team above a `gpus.<MODEL>` key's nominal + borrowing
limit, no non-preemptible job above its team's nominal of that model, and no model's lending
pool lending more than the teams that declare it lend (`quota.ModelQuota`).

A mixin of the audit's replay (`audit._Auditor`), as `audit_rules.RuleChecks` is: the replay
calls `charge_models` when a gang starts (admit) and when a running gang stops. Held partial
gangs count nothing: a policy that holds them does not enforce per-model keys (decision 0022).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from scheduling.cluster import Cluster
from scheduling.quota import ModelQuota, Team
from scheduling.resources import GPU_UNIT
from scheduling.simulator.trace import TraceJob

__all__ = ["ModelQuotaChecks"]

Rep = tuple[int, tuple[int, ...], int]  # node, GPUs, share (milli)


class ModelQuotaChecks:
    """Per (team, model) usage rebuilt from the placements the log shows."""

    cluster: Cluster
    teams: Mapping[str, Team]

    def flag(self, job: str, rule: str, message: str) -> None: ...

    def init_models(self, enforced: bool) -> None:
        self.model_quotas: dict[str, dict[str, ModelQuota]] = {
            n: {q.model: q for q in t.models} for n, t in self.teams.items() if t.models
        }
        self.models_enforced = enforced and bool(self.model_quotas)
        self.model_usage: dict[tuple[str, str], int] = {}
        self.model_pool: dict[str, int] = {}  # model -> what the declaring teams lend in all
        for quotas in self.model_quotas.values():
            for q in quotas.values():
                self.model_pool[q.model] = self.model_pool.get(q.model, 0) + q.lends

    def charge_models(self, job: TraceJob, reps: Iterable[Rep], sign: int) -> None:
        quotas = self.model_quotas.get(job.team)
        if not quotas:
            return
        by_model: dict[str, int] = {}
        for node, gpus, share in reps:
            model = self.cluster.nodes[node].gpu_model
            by_model[model] = by_model.get(model, 0) + (share or GPU_UNIT * len(gpus))
        for model, gpu in by_model.items():
            q = quotas.get(model)
            if q is None:
                continue
            used = self.model_usage[job.team, model] = (
                self.model_usage.get((job.team, model), 0) + sign * gpu
            )
            if sign < 0 or not self.models_enforced:
                continue
            key = f"gpus.{model}"
            if used > q.ceiling:
                self.flag(
                    job.job_id,
                    "quota",
                    f"team {job.team} uses {used / GPU_UNIT:g} {key}, above its nominal + "
                    f"borrowing_limit of {q.ceiling / GPU_UNIT:g}",
                )
            if not job.preemptible and used > q.nominal:
                self.flag(
                    job.job_id,
                    "quota",
                    f"non-preemptible, and team {job.team} is above its nominal {key}",
                )
            lent = sum(
                max(self.model_usage.get((team, model), 0) - qs[model].guaranteed, 0)
                for team, qs in self.model_quotas.items()
                if model in qs
            )
            if lent > self.model_pool.get(model, 0):
                self.flag(job.job_id, "quota", f"the cohort lends more {key} than its teams lend")
