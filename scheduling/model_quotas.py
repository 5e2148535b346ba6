"""Where a job may be placed by its team's per-model quotas, in a cycle (decision 0022).

After the total quota check, the models a job accepts are narrowed to those whose `gpus.<MODEL>`
key has room for all of it now (a gang lives on one model; a mixed gang is held to models that
could take all of it), and the policy places it on those: as Kueue assigns a flavor whose quota
fits before the pods are placed. A MIG job must also have room for all its instances in its
team's `mig.<profile>` key, where that profile is governed (decision 0024). Read from the
cycle's own ledger, which its admissions and preemptions keep up to date.
"""

from __future__ import annotations

from dataclasses import replace

from scheduling.capacity import Capacity
from scheduling.cluster import Cluster
from scheduling.jobs import Job, Placement
from scheduling.models import key_amount, mig_key
from scheduling.quota import QuotaLedger, QuotaProblem
from scheduling.strategies import Placer


class ModelQuotaPlacer:
    """The policy's placer, narrowed per job to the models its team's keys leave room on."""

    def __init__(self, quota: QuotaLedger, cluster: Cluster, placement: Placer) -> None:
        self.quota, self.cluster, self.placement = quota, cluster, placement
        self._narrowed: dict[tuple[str, tuple[str, ...]], Job] = {}  # made once a cycle

    def models(self, job: Job) -> tuple[str, ...] | None:
        """The models the job accepts (in its order, else the cluster's) that its team's
        per-model quotas leave room on for all of it now; None: no model is governed."""
        if not self.quota.declared_models(job.team):
            return None
        if self._mig_problem(job) is not None:
            return ()
        return tuple(
            m
            for m in (job.gpu_models or self.cluster.models)
            if m in self.cluster.model_nodes
            and self.quota.model_problem(job.team, m, job.demand.gpu, job.preemptible) is None
        )

    def problem(self, job: Job) -> QuotaProblem | None:
        """Why no model the job accepts has room in its team's per-model quotas (the first
        accepted model's reason), or None; first, why its MIG profile's key has no room."""
        first = self._mig_problem(job)
        if first is not None:
            return first
        for m in job.gpu_models or self.cluster.models:
            problem = self.quota.model_problem(job.team, m, job.demand.gpu, job.preemptible)
            if problem is None:
                return None
            first = first or problem
        return first

    def _mig_problem(self, job: Job) -> QuotaProblem | None:
        key = mig_key(job)
        if key is None:
            return None
        return self.quota.model_problem(job.team, key, key_amount(job, key), job.preemptible)

    def narrowed(self, job: Job) -> Job:
        """The job narrowed to the models its team's quotas leave room on (itself where
        nothing is narrowed, or no model has room)."""
        models = self.models(job)
        if not models or models == (job.gpu_models or self.cluster.models):
            return job
        key = (job.id, models)
        out = self._narrowed.get(key)
        if out is None:
            out = self._narrowed[key] = replace(job, gpu_models=models)
        return out

    def on_ledger(self, quota: QuotaLedger) -> ModelQuotaPlacer:
        """The same narrowing read from another ledger: a preemption search's trial one, in
        which its victims' GPUs of each model are given back."""
        return (
            self if quota is self.quota else ModelQuotaPlacer(quota, self.cluster, self.placement)
        )

    def __call__(self, cap: Capacity, job: Job) -> Placement | None:
        if self.models(job) == ():
            return None  # room on no model
        return self.placement(cap, self.narrowed(job))
