"""The audit's per-model quota rule: no team above its nominal + borrowing limit of a governed
model (one some team declares a `gpus.<MODEL>` key for; a team without a key has a nominal of
0), no non-preemptible job above its team's nominal of it, and no model's pool lending more
than it holds (what the declaring teams lend and what no nominal claims: `quota.model_quotas`).
A MIG profile's `mig.<profile>` key is held as a model of that name, counting instances (1000
each: a MIG job's replicas hold one instance of its profile each, which the audit's placement
check makes sure of).

A mixin of the audit's replay (`audit._Auditor`), as `audit_rules.RuleChecks` is: the replay
calls `charge_models` when a gang starts (admit) and when a running gang stops. Held partial
gangs count nothing: a policy that holds them does not enforce per-model keys (decision 0022).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from scheduling.cluster import Cluster
from scheduling.quota import MIG_KEY, ModelQuota, Team, model_quotas, quota_key
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
        # Every team's quota of each governed model, and the models' pools: what the quotas
        # say (`quota.model_quotas`); the usage is rebuilt here from the log alone.
        gpus = {m: GPU_UNIT * sum(self.cluster.nodes[i].gpus for i in nodes)
                for m, nodes in self.cluster.model_nodes.items()}  # fmt: skip
        for node in self.cluster.nodes:  # and each MIG profile's instances
            for _, profile in node.mig:
                gpus[MIG_KEY + profile] = gpus.get(MIG_KEY + profile, 0) + GPU_UNIT
        self.model_quotas: dict[str, dict[str, ModelQuota]]
        self.model_quotas, self.model_pool = model_quotas(self.teams, gpus)
        self.models_enforced = enforced and bool(self.model_quotas)
        self.model_usage: dict[tuple[str, str], int] = {}
        # The current cycle: per-model usage before it, and each decision's GPUs per model.
        self.model_base: dict[tuple[str, str], int] = {}
        self.cycle_models: dict[tuple[str, str], dict[str, int]] = {}

    def models_of(self, reps: Iterable[Rep], job: TraceJob | None = None) -> dict[str, int]:
        """GPUs (milli) per model of some replicas (of `job`: then a MIG job's instances in
        its profile's key too)."""
        by_model: dict[str, int] = {}
        n = 0
        for node, gpus, share in reps:
            model = self.cluster.nodes[node].gpu_model
            by_model[model] = by_model.get(model, 0) + (share or GPU_UNIT * len(gpus))
            n += 1
        if job is not None and job.mig_profile and n:
            by_model[MIG_KEY + job.mig_profile] = GPU_UNIT * n
        return by_model

    def model_reclaim(
        self, job: TraceJob, victims: list[TraceJob], usage: Mapping[tuple[str, str], int]
    ) -> bool:
        """Is this admission, with these victims of other teams, a reclaim of one model
        (scheduling/model_reclaim.py)? The job on one governed model, within its team's nominal
        of it; every victim on that model, of a team that borrowed it, none left below its
        nominal of it where the policy keeps victims' nominal. `usage`: per (team, model)
        before the admission, in decision order."""
        placed = self.cycle_models.get(("admit", job.job_id), {})
        quotas = self.model_quotas.get(job.team)
        if not quotas:
            return False
        # A gang is on one model; a MIG job counts in its profile's key too: a reclaim of
        # either.
        models = [m for m in placed if m in quotas]
        if not models or len([m for m in placed if not m.startswith(MIG_KEY)]) != 1:
            return False
        return any(self._reclaims(job, victims, usage, m, placed[m]) for m in models)

    def _reclaims(
        self,
        job: TraceJob,
        victims: list[TraceJob],
        usage: Mapping[tuple[str, str], int],
        model: str,
        gpu: int,
    ) -> bool:
        usage = dict(usage)
        quotas = self.model_quotas[job.team]
        for v in victims:
            got = self.cycle_models.get(("preempt", v.job_id), {}).get(model, 0)
            q = self.model_quotas.get(v.team, {}).get(model)
            before = usage.get((v.team, model), 0)
            if not got or q is None or before <= q.nominal:
                return False
            usage[v.team, model] = before - got
            if self.policy.victim_keeps_nominal and usage[v.team, model] < q.nominal:
                return False
        return usage.get((job.team, model), 0) + gpu <= quotas[model].nominal

    def charge_models(self, job: TraceJob, reps: Iterable[Rep], sign: int) -> None:
        quotas = self.model_quotas.get(job.team)
        if not quotas:
            return
        for model, gpu in self.models_of(reps, job).items():
            q = quotas.get(model)
            if q is None:
                continue
            used = self.model_usage[job.team, model] = (
                self.model_usage.get((job.team, model), 0) + sign * gpu
            )
            if sign < 0 or not self.models_enforced:
                continue
            key = quota_key(model)
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
