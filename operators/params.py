"""The trigger form of the lifecycle DAG: Params for the JobSpec fields a UI user fills in.

The Params are named as the JobSpec fields (so an error names the box to fix), except where the
form needs a flat value: `requirements` (and `python`) stand for `environment`, and an empty
`image` or `time_limit_s` means "not given". `spec_from_params` turns a run's params (the form,
or the `conf` of `POST /api/v2/dags/berth_job/dagRuns`, which Airflow merges into params) back
into a spec mapping for `parse_spec`, which does the checking.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

from airflow.sdk import Param

from berth.pools import CONF_DEFAULTS
from berth.spec_fields import Topology
from scheduling.cluster import Cluster
from scheduling.mig import slices_of
from scheduling.quota import Team

# A spec given as this string is read from the DAG run's params when the task runs.
FROM_PARAMS = "params"


# The form's sections, in Airflow's trigger form order.
JOB, RESOURCES, ENVIRONMENT, DATA, ADVANCED = "Job", "Resources", "Environment", "Data", "Advanced"
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"  # a DNS-1123 label that starts with a letter


def job_params(
    teams: list[str],
    default_command: list[str],
    default_image: str | None = None,
    models: list[str] | None = None,
    cohorts: Mapping[str, str] | None = None,
    mig_profiles: list[str] | None = None,
) -> dict[str, Param]:
    """Params for every JobSpec field a UI user needs; `teams` is the team enum;
    `default_image` fills the image field (on Kubernetes: BERTH_JOB_IMAGE, which holds the
    default command's script); `models`, the cluster's GPU models, fastest first, where known:
    the GPU model box is then a pick list of them (several: a multi-select, in the order
    picked), else free text. `cohorts`: where a team sits in the organization tree (team ->
    'lab < department'), shown beside it in the team box. `mig_profiles`: the cluster's MIG
    profiles, where known (a pick list; else free text).

    The team has no default: a user picks one, or would be charged to the first team without
    noticing (a REST call without it is refused, naming the field). Optional fields accept
    null, so the form does not mark them required."""

    def optional_list(title: str, section: str, description: str) -> Param:
        return Param(
            None,
            type=["null", "array"],
            items={"type": "string"},
            title=title,
            section=section,
            description=description,
        )

    def optional_seconds_or_gb(title: str, section: str, description: str) -> Param:
        return Param(
            None,
            type=["null", "number"],
            exclusiveMinimum=0,
            title=title,
            section=section,
            description=description,
        )

    # Where each team sits in the organization tree, beside its name in the box.
    in_tree: dict[str, Any] = {}
    if cohorts:
        shown = {t: f"{t} (cohort {cohorts[t]})" if t in cohorts else t for t in teams}
        in_tree["values_display"] = shown
    return {
        "name": Param(
            "train-demo",
            type="string",
            pattern=NAME_PATTERN,
            maxLength=63,
            title="Job name",
            section=JOB,
            description="Lowercase letters, digits and '-', starting with a letter; it names the "
            "job's pods and MLflow runs.",
        ),
        "team": Param(
            type="string",
            enum=teams,
            **in_tree,
            title="Team",
            section=JOB,
            description="Whose GPU quota the job uses: one of your teams (where the admins "
            "list who may use which team, another team's is refused before anything is queued).",
        ),
        "command": Param(
            default_command,
            type="array",
            items={"type": "string"},
            title="Command",
            section=JOB,
            description="Program and arguments, one per line, e.g. python / train.py.",
        ),
        "priority": Param(
            0,
            type="integer",
            minimum=-1000,
            maximum=1000,
            title="Priority",
            section=JOB,
            description="Within your team: higher goes first, and may preempt lower.",
        ),
        "replicas": Param(
            CONF_DEFAULTS["replicas"],
            type="integer",
            minimum=1,
            title="Replicas",
            section=RESOURCES,
            description="Processes in the gang: all start together or none does.",
        ),
        "gpus_per_replica": Param(
            CONF_DEFAULTS["gpus_per_replica"],
            type="number",
            exclusiveMinimum=0,
            title="GPUs per replica",
            section=RESOURCES,
            description="Whole GPUs, or a share of one like 0.25.",
        ),
        "cpus_per_replica": Param(
            1,
            type="number",
            exclusiveMinimum=0,
            title="CPUs per replica",
            section=RESOURCES,
            description="CPU cores each replica needs.",
        ),
        "memory_gb_per_replica": Param(
            4,
            type="number",
            exclusiveMinimum=0,
            title="Memory per replica (GB)",
            section=RESOURCES,
            description="Memory each replica needs, in GB.",
        ),
        "topology": Param(
            "any",
            type="string",
            enum=list(get_args(Topology)),
            title="Topology",
            section=RESOURCES,
            description="The smallest domain every replica must share (node, rack, ...).",
        ),
        "gpu_model": _gpu_models(models),
        "mixed_models": Param(
            False,
            type="boolean",
            title="Mixed GPU models",
            section=RESOURCES,
            description="Replicas may run on different GPU models (the gang then steps at the "
            "pace of the slowest).",
        ),
        "mig_profile": _mig_profile(mig_profiles),
        "preemptible": Param(
            True,
            type="boolean",
            title="Preemptible",
            section=RESOURCES,
            description="May be stopped for a job of higher priority or for a team reclaiming "
            "its quota (it goes back to the queue without using a retry).",
        ),
        "time_limit_s": optional_seconds_or_gb(
            "Time limit (s)",
            RESOURCES,
            "Stop a run after this long; a job with a limit may start sooner (backfill).",
        ),
        "requirements": optional_list(
            "pip requirements",
            ENVIRONMENT,
            "The job's Python environment, one requirement per line; leave empty with an image.",
        ),
        "python": Param(
            None,
            type=["null", "string"],
            title="Python version",
            section=ENVIRONMENT,
            description="e.g. 3.11; empty: the platform's.",
        ),
        "image": Param(
            default_image,
            type=["null", "string"],
            title="Container image",
            section=ENVIRONMENT,
            description="An image instead of pip requirements.",
        ),
        "env": Param(
            None,
            type=["null", "object"],
            title="Environment variables",
            section=ENVIRONMENT,
            description="Extra variables for every replica, e.g. {SEED: '1'}.",
        ),
        "secrets": Param(
            None,
            type=["null", "object"],
            additionalProperties={"type": "string"},
            title="Secrets",
            section=ENVIRONMENT,
            description="Variables from Kubernetes Secrets of the team's namespace, "
            "e.g. {HF_TOKEN: 'hf-token/token'}; the values never pass through Airflow.",
        ),
        "inputs": optional_list(
            "Inputs", DATA, "Data staged before the job starts, e.g. file:///data/set.npz."
        ),
        "artifacts": optional_list(
            "Artifacts", DATA, "Paths the job writes, kept after each attempt."
        ),
        "retries": Param(
            0,
            type="integer",
            minimum=0,
            maximum=20,
            title="Retries",
            section=ADVANCED,
            description="Times a failed run is tried again (a preemption uses none).",
        ),
        "retry_backoff_s": Param(
            30,
            type="number",
            exclusiveMinimum=0,
            title="Retry backoff (s)",
            section=ADVANCED,
            description="Wait before a retry.",
        ),
        "recoverable_exit_codes": Param(
            None,
            type=["null", "array"],
            items={"type": "integer"},
            title="Recoverable exit codes",
            section=ADVANCED,
            description="Exit codes that run the job again without using a retry, e.g. 75 "
            "for a lost NCCL peer.",
        ),
        "checkpoint_every_s": optional_seconds_or_gb(
            "Checkpoint every (s)",
            ADVANCED,
            "How often the job saves a checkpoint in BERTH_CHECKPOINT_DIR; a preemption then "
            "loses only the work since.",
        ),
        "shm_gb_per_replica": optional_seconds_or_gb(
            "Shared memory per replica (GB)",
            ADVANCED,
            "Kubernetes: the memory-backed /dev/shm for data loaders and NCCL, part of the "
            "replica's memory; empty: half of it.",
        ),
        "register_model": Param(
            None,
            type=["null", "object"],
            title="Register a model",
            section=ADVANCED,
            description="Register the model in MLflow: {name: ..., path: model}.",
        ),
    }


def spec_from_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A spec mapping from a run's params; unknown keys go through, so parse_spec names them.
    With a MIG profile the form's GPUs per replica (always sent) is left out: the instance's
    compute share counts."""
    spec = {k: v for k, v in params.items() if v is not None}
    if spec.get("mig_profile"):
        spec.pop("gpus_per_replica", None)
    reqs = spec.pop("requirements", None) or []
    python = spec.pop("python", None)
    if not spec.get("image"):
        spec.pop("image", None)
        environment: dict[str, Any] = {"requirements": list(reqs)}
        if python:
            environment["python"] = python
        spec["environment"] = environment
    elif reqs:  # both given: let parse_spec explain the conflict
        spec["environment"] = {"requirements": list(reqs)}
    return spec


def _gpu_models(models: list[str] | None) -> Param:
    """The GPU model box: Airflow's form shows an array Param with `examples` as a
    multi-select; a cluster of one model has nothing to pick."""
    text = "Every replica runs on one model unless mixed models are allowed."
    if models and len(models) > 1:
        return Param(
            None,
            type=["null", "array"],
            items={"type": "string", "enum": models},
            examples=models,
            title="GPU models",
            section=RESOURCES,
            description=f"The GPU models the job accepts, preferred first; empty: any of "
            f"{', '.join(models)}. {text}",
        )
    known = f" (this cluster's: {models[0]})" if models else " (e.g. H100, A100)"
    return Param(
        None,
        type=["null", "array"],
        items={"type": "string"},
        title="GPU models",
        section=RESOURCES,
        description=f"The GPU models the job accepts, one per line, preferred first{known}; "
        f"empty: any. {text}",
    )


def _mig_profile(profiles: list[str] | None) -> Param:
    text = "One MIG instance per replica instead of GPUs (GPUs per replica is then ignored)"
    if profiles:
        return Param(
            None,
            type=["null", "string"],
            enum=[None, *profiles],
            title="MIG profile",
            section=RESOURCES,
            description=f"{text}; this cluster has: {', '.join(profiles)}.",
        )
    return Param(
        None,
        type=["null", "string"],
        title="MIG profile",
        section=RESOURCES,
        description=f"{text}, e.g. 1g.10gb; empty: whole or fractional GPUs.",
    )


def form_mig_profiles(cluster: Cluster | None) -> list[str] | None:
    """A cluster's MIG profiles for the form, smallest first; None where it has none or the
    cluster is not at hand."""
    if cluster is None:
        return None
    found = {p for n in cluster.nodes for _, p in n.mig}
    return sorted(found, key=lambda p: (slices_of(p), p)) or None


def form_models(cluster: Cluster | None) -> list[str] | None:
    """A cluster's GPU models for the form, fastest first (its `gpu_speed`, then its order);
    None where the cluster is not at hand (discovered from Kubernetes: reading it at parse
    time would reach the store)."""
    if cluster is None:
        return None
    return sorted(cluster.models, key=lambda m: -cluster.gpu_speed.get(m, 1.0))


def form_cohorts(teams: Mapping[str, Team]) -> dict[str, str]:
    """Where each team sits in the organization tree, for the form's team box: its cohorts,
    the closest first ('lab < department'); teams outside any cohort are left out."""
    return {n: " < ".join(c.name for c in t.cohorts) for n, t in teams.items() if t.cohorts}
