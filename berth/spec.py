"""The job spec an ML engineer fills in, validated once here and handed to the engine as a Job.

`parse_spec` checks a mapping (from an Airflow DAG, the trigger form, YAML or JSON) and reports
every problem at once in a `SpecError`: each names its field path (`inputs[2]`,
`environment.requirements[0]`), what is wrong and how to fix it. `check_spec` adds, in the same
form, what only the cluster and the teams can tell: a job too big to ever run, an unknown team.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from berth.spec_fields import (
    ARTIFACT_FIX,
    ENV_KEY_RE,
    SPEC_EXAMPLE,
    URI_FIX,
    Topology,
    artifact_path,
    command_line,
    engine_min,
    env_key,
    gpu_models,
    gpu_request,
    image_ref,
    input_uri,
    job_name,
    mig_profile_name,
    non_blank,
    python_version,
    recoverable_exit_code,
    requirement,
    secret_ref,
)
from scheduling.admission import check_job
from scheduling.cluster import Cluster
from scheduling.jobs import Job
from scheduling.mig import profile_problem, share_of
from scheduling.quota import Team
from scheduling.resources import CPU_UNIT, GPU_UNIT, MEM_UNIT, Resources

Positive = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]


class Environment(BaseModel):
    """A Python environment Berth builds for the job: pip requirements on a Python base image."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requirements: tuple[Annotated[str, AfterValidator(requirement)], ...] = ()
    # None: the platform's default
    python: Annotated[str, AfterValidator(python_version)] | None = None


class ModelRegistration(BaseModel):
    """Register the model of the job's successful attempt in MLflow's Model Registry: the
    artifact folder `path` of the attempt's run (what the training code logged there with
    `mlflow.log_artifact(..., artifact_path=path)`, or a collected artifact) as a new version
    of the registered model `name`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, AfterValidator(non_blank("name the registered model, e.g. 'resnet50'"))]
    path: Annotated[str, AfterValidator(artifact_path)] = "model"


class JobSpec(BaseModel):
    """What an ML engineer asks for; `parse_spec` builds one and explains what is wrong.

    Rules, each only what is clearly wrong (the cluster-dependent ones are in `check_spec`):
    - `name` is a DNS-1123 label that starts with a letter: it names the job's pods.
    - `team` and `experiment` are not blank; `experiment` None means the DAG id.
    - Exactly one of `image` (a container image reference, tag and/or sha256 digest) and
      `environment` (pip requirements, optional Python 3 version; no pip options).
    - `command` is an argv list whose first item is a program without spaces.
    - `gpus_per_replica` (no default) is a whole number >= 1 or a share of one GPU from 0.001
      to 0.999; 0 is refused (Berth schedules GPU jobs). CPUs and memory are > 0 and at least
      one engine unit (0.001 CPU, 1 MiB). Numbers are strict: `true` is not 1, "4" is not 4.
    - `shm_gb_per_replica` (Kubernetes: the memory-backed /dev/shm) is at most the replica's
      memory, which its pages count against.
    - `priority` is within -1000..1000, `retries` within 0..20, times are finite and > 0, and
      `retry_backoff_max_s` >= `retry_backoff_s`; `recoverable_exit_codes` are exit codes
      (1..255) or signals (-1..-64), never 0.
    - `inputs` are s3://bucket/key, file:///absolute/path or https:// URIs; `artifacts` are
      relative paths that stay inside the working directory.
    - `env` names are shell identifiers, and none that the platform sets (`RESERVED_ENV`).
    - `register_model` (optional): register the successful attempt's model in MLflow.

    Lists arrive as tuples, so that a parsed spec cannot change.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, AfterValidator(job_name)]
    team: Annotated[str, AfterValidator(non_blank("give your team's name as in teams.yaml"))]
    experiment: (
        Annotated[str, AfterValidator(non_blank("leave it out to log under the DAG id"))] | None
    ) = None
    image: Annotated[str, AfterValidator(image_ref)] | None = None
    environment: Environment | None = None
    command: Annotated[tuple[str, ...], AfterValidator(command_line)]
    replicas: Annotated[int, Field(strict=True, ge=1)] = 1
    gpus_per_replica: Annotated[
        float, Field(strict=True, allow_inf_nan=False), AfterValidator(gpu_request)
    ]
    cpus_per_replica: Annotated[Positive, AfterValidator(engine_min(CPU_UNIT, "0.001 CPU"))] = 1.0
    memory_gb_per_replica: Annotated[
        Positive, AfterValidator(engine_min(MEM_UNIT, "1 MiB (0.001 GiB)"))
    ] = 4.0
    # Kubernetes: the replica's memory-backed /dev/shm (None: half its memory); part of it.
    shm_gb_per_replica: (
        Annotated[Positive, AfterValidator(engine_min(MEM_UNIT, "1 MiB (0.001 GiB)"))] | None
    ) = None
    topology: Topology = "any"
    # The GPU models the job accepts, preferred first (one name or a list; empty: any); every
    # replica runs on one of them unless `mixed_models` (docs/decisions/0022).
    gpu_model: Annotated[tuple[str, ...], BeforeValidator(gpu_models)] = ()
    mixed_models: Annotated[bool, Field(strict=True)] = False
    # One MIG instance of this profile per replica (e.g. '1g.10gb'; docs/decisions/0024):
    # `gpus_per_replica` may then be left out, it is the instance's compute share.
    mig_profile: Annotated[str, AfterValidator(mig_profile_name)] | None = None
    priority: Annotated[int, Field(strict=True, ge=-1000, le=1000)] = 0
    preemptible: Annotated[bool, Field(strict=True)] = True
    retries: Annotated[int, Field(strict=True, ge=0, le=20)] = 0
    retry_backoff_s: Positive = 30.0
    retry_backoff_max_s: Positive = 3600.0
    # Exit codes that mean "run me again", not "I am broken" (a lost NCCL peer, a flaky
    # filesystem): an attempt that exits with one goes back to the queue as a lost one does,
    # using no retry, up to MAX_RECOVERIES times (berth/store/lifecycle.py).
    recoverable_exit_codes: tuple[
        Annotated[int, Field(strict=True), AfterValidator(recoverable_exit_code)], ...
    ] = ()
    time_limit_s: Positive | None = None
    # The job saves a checkpoint in BERTH_CHECKPOINT_DIR at least this often: a preemption
    # then loses only the work since, and the engine prefers victims that just saved.
    checkpoint_every_s: Positive | None = None
    inputs: tuple[Annotated[str, AfterValidator(input_uri)], ...] = ()
    artifacts: tuple[Annotated[str, AfterValidator(artifact_path)], ...] = ()
    env: dict[Annotated[str, AfterValidator(env_key)], str] = Field(default_factory=dict)
    # Variables read from Kubernetes Secrets in the team's namespace ('name/key'): the pod
    # names the Secret and the kubelet fills the value in, so it never passes through Berth,
    # Airflow's database or the pod's spec.
    secrets: dict[
        Annotated[str, AfterValidator(env_key)], Annotated[str, AfterValidator(secret_ref)]
    ] = Field(default_factory=dict)
    register_model: ModelRegistration | None = None

    @model_validator(mode="before")
    @classmethod
    def _mig_share(cls, data: Any) -> Any:
        """A MIG job's GPUs per replica are its instance's compute share: filled in when left
        out (for a bad profile with 1, so that the profile's own error is the one said)."""
        if isinstance(data, Mapping) and "gpus_per_replica" not in data:
            profile = data.get("mig_profile")
            if isinstance(profile, str):
                share = share_of(profile) if profile_problem(profile) is None else GPU_UNIT
                return {**data, "gpus_per_replica": share / GPU_UNIT}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        problems = _conflicts(self.__dict__)
        if problems:
            pairs = [(p.field, p.message) for p in problems]  # plain data, for e.json()
            ctx = {"text": "; ".join(map(str, problems)), "problems": pairs}
            raise PydanticCustomError("spec_conflict", "{text}", ctx)
        return self

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait before retry `attempt` (1 = the first): doubling, capped."""
        if attempt < 1:
            raise ValueError(f"attempt counts retries from 1, got {attempt}")
        try:
            delay = self.retry_backoff_s * 2.0 ** (attempt - 1)
        except OverflowError:
            return self.retry_backoff_max_s
        return min(delay, self.retry_backoff_max_s)

    def to_job(self, job_id: str, submit_time: float) -> Job:
        """The engine's view: per-replica GPUs, CPUs and memory in integer units."""
        r = Resources.of(self.gpus_per_replica, self.cpus_per_replica, self.memory_gb_per_replica)
        return Job(
            id=job_id,
            team=self.team,
            replicas=self.replicas,
            gpu=share_of(self.mig_profile) if self.mig_profile else r.gpu,
            cpu=r.cpu,
            mem=r.mem,
            priority=self.priority,
            topology=self.topology,
            preemptible=self.preemptible,
            submit_time=submit_time,
            time_limit_s=math.inf if self.time_limit_s is None else self.time_limit_s,
            checkpoint_s=math.inf if self.checkpoint_every_s is None else self.checkpoint_every_s,
            gpu_models=self.gpu_model,
            mixed_models=self.mixed_models,
            mig=self.mig_profile or "",
        )


@dataclass(frozen=True, slots=True)
class SpecProblem:
    """A field path (`inputs[2]`, `env.RANK`; '' for the whole spec) and what to do about it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field or '(spec)'}: {self.message}"


class SpecError(ValueError):
    """A job spec is malformed or can never run; `problems` has them all, str() one per line."""

    def __init__(self, problems: Sequence[SpecProblem]) -> None:
        self.problems = list(problems)
        super().__init__(self.problems)

    def __str__(self) -> str:
        return "\n".join(map(str, self.problems))


def parse_spec(data: Mapping[str, Any]) -> JobSpec:
    """Validate a job spec; raises SpecError listing every problem, each with its fix."""
    if not isinstance(data, Mapping):
        got = type(data).__name__
        raise SpecError(
            [SpecProblem("", f"must be a mapping of fields to values, got a {got}; {SPEC_EXAMPLE}")]
        )
    try:
        return JobSpec.model_validate(dict(data))
    except ValidationError as e:
        errors = e.errors()
    problems = [_problem(err) for err in errors if err["type"] != "spec_conflict"]
    if len(problems) == len(errors):  # field errors stop pydantic before the cross-field rules
        problems += _conflicts(data, skip={_top(p.field) for p in problems})
    else:
        problems += [p for err in errors if err["type"] == "spec_conflict" for p in _ctx(err)]
    order = {name: i for i, name in enumerate(JobSpec.model_fields)}
    raise SpecError(sorted(problems, key=lambda p: order.get(_top(p.field), len(order))))


def check_spec(
    spec: JobSpec,
    cluster: Cluster,
    teams: Mapping[str, Team],
    *,
    quotas: bool = True,
    fit: bool = True,
) -> SpecError | None:
    """None if the job could run some day on this cluster; else why not, as a SpecError.

    "Some day" is `admission.check_job`'s: on the empty cluster, with the team's whole
    reachable quota (when `quotas`). An unknown team, a topology level the cluster lacks and a
    job that can never fit come out in the same form as a malformed spec; a job over its team's
    quota that would not fit the empty cluster either is told both. `fit=False` skips the
    last (a discovered cluster may be smaller now than it will be).
    """
    job = spec.to_job(spec.name, 0.0)
    invalid = check_job(job, cluster, teams, quotas=False, fit=False)
    if invalid is not None:  # the rest would not make sense of it
        return SpecError([SpecProblem(invalid.field, invalid.message)])
    # Both of these, when both fail: the user fixes them in one go.
    found = [
        check_job(job, cluster, teams, quotas=True, fit=False) if quotas else None,
        check_job(job, cluster, teams, quotas=False, fit=True) if fit else None,
    ]
    problems = [SpecProblem(r.field, r.message) for r in found if r is not None]
    return SpecError(problems) if problems else None


def _conflicts(values: Mapping[str, Any], skip: set[str] | None = None) -> list[SpecProblem]:
    """Rules across fields, over parsed or raw values; fields in `skip` already have a problem."""
    skip = skip or set()
    out = []
    given = [k for k in ("image", "environment") if values.get(k) is not None]
    if len(given) != 1:
        which = "both image and environment are" if given else "neither image nor environment is"
        out.append(
            SpecProblem(
                "image",
                f"{which} set; give exactly one: image (a container image, e.g. "
                "'ghcr.io/org/train:1.2') or environment (what Berth installs, e.g. "
                "{requirements: ['torch==2.3.1'], python: '3.11'})",
            )
        )
    fields = JobSpec.model_fields
    base = values.get("retry_backoff_s", fields["retry_backoff_s"].default)
    most = values.get("retry_backoff_max_s", fields["retry_backoff_max_s"].default)
    shm = values.get("shm_gb_per_replica")
    memory = values.get("memory_gb_per_replica", fields["memory_gb_per_replica"].default)
    judged = not skip & {"shm_gb_per_replica", "memory_gb_per_replica"}
    if judged and _number(shm) and _number(memory) and shm > memory:
        out.append(
            SpecProblem(
                "shm_gb_per_replica",
                f"{shm:g} is more than memory_gb_per_replica ({memory:g}): /dev/shm's pages count "
                "against the replica's memory; lower it or raise memory_gb_per_replica",
            )
        )
    env, secrets = values.get("env"), values.get("secrets")
    if isinstance(env, Mapping) and isinstance(secrets, Mapping) and "secrets" not in skip:
        out.extend(
            SpecProblem(
                f"secrets.{name}",
                f"{name} is also in env; a variable comes from env or from a Secret, not both: "
                "remove one",
            )
            for name in sorted(set(env) & set(secrets))
        )
    profile, gpus = values.get("mig_profile"), values.get("gpus_per_replica")
    judged = not skip & {"mig_profile", "gpus_per_replica"}
    if judged and isinstance(profile, str) and not profile_problem(profile) and _number(gpus):
        share = share_of(profile)
        if round(gpus * GPU_UNIT) != share:
            out.append(
                SpecProblem(
                    "gpus_per_replica",
                    f"a {profile} MIG instance counts {share / GPU_UNIT:g} GPUs (its compute "
                    f"share), got {gpus:g}; leave gpus_per_replica out or give that",
                )
            )
    judged = not skip & {"retry_backoff_s", "retry_backoff_max_s"}
    if judged and _number(base) and _number(most) and most < base:
        out.append(
            SpecProblem(
                "retry_backoff_max_s",
                f"must be at least retry_backoff_s ({base:g}), got {most:g}; raise "
                "retry_backoff_max_s or lower retry_backoff_s",
            )
        )
    return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _ctx(err: ErrorDetails) -> list[SpecProblem]:
    return [SpecProblem(*pair) for pair in err.get("ctx", {}).get("problems", [])]


def _top(path: str) -> str:
    return re.split(r"[.\[]", path, maxsplit=1)[0]


def _path(loc: tuple[int | str, ...]) -> str:
    """('environment', 'requirements', 0) -> 'environment.requirements[0]'."""
    out = ""
    for part in loc:
        if part == "[key]":  # pydantic's marker for a dict key; the key itself is already there
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif ENV_KEY_RE.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out


# How to fix a field, for problems pydantic finds (missing, wrong type, out of range).
_FIX = {
    "name": "give a short name such as 'train-bert'",
    "team": "give your team's name as in teams.yaml, e.g. 'vision'",
    "experiment": "give an MLflow experiment name, or leave it out to use the DAG id",
    "image": "give a container image such as 'ghcr.io/org/train:1.2'",
    "environment": "give e.g. {requirements: ['torch==2.3.1'], python: '3.11'}",
    "environment.requirements": "give a list of pip requirements such as ['torch==2.3.1']",
    "environment.python": "quote the version, e.g. '3.10' (unquoted, YAML reads 3.10 as 3.1)",
    "command": "give the program and its arguments, e.g. ['python', 'train.py']",
    "replicas": "give the number of replicas in the gang, e.g. 4",
    "gpus_per_replica": "give whole GPUs such as 2, or a share of one GPU such as 0.25",
    "cpus_per_replica": "give CPUs per replica, e.g. 8 or 0.5",
    "memory_gb_per_replica": "give GiB of memory per replica, e.g. 32",
    "topology": "'node' keeps a gang on one machine, 'any' lets Berth choose",
    "gpu_model": "give a GPU model such as 'H100', or a list such as ['H100', 'A100']",
    "mixed_models": "write true (replicas may run on different GPU models) or false",
    "mig_profile": "give a MIG profile the cluster's nodes declare, e.g. '1g.10gb', or leave it "
    "out for whole or fractional GPUs",
    "priority": "give a whole number from -1000 to 1000; 0 is normal",
    "preemptible": "write true (Berth may stop and requeue the job) or false",
    "retries": "give how many times to retry a failed run, from 0 to 20",
    "retry_backoff_s": "give seconds to wait before the first retry, e.g. 30",
    "retry_backoff_max_s": "give the longest wait between retries in seconds, e.g. 3600",
    "recoverable_exit_codes": "give a list of exit codes that run the job again without a "
    "retry, e.g. [75]",
    "time_limit_s": "give the most seconds a run may take, e.g. 86400, or leave it out",
    "inputs": f"give a list of URIs; {URI_FIX}",
    "artifacts": f"give a list of paths; {ARTIFACT_FIX}",
    "env": "give names and string values, e.g. {SEED: '42'}",
    "secrets": "give variable names and '<Secret name>/<key>', e.g. {HF_TOKEN: 'hf/token'}",
}
_EXPECTED = {
    "string_type": "a string",
    "int_type": "a whole number",
    "float_type": "a number",
    "bool_type": "true or false",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
}
_BOUND = {
    "greater_than": ("more than", "gt"),
    "greater_than_equal": ("at least", "ge"),
    "less_than_equal": ("at most", "le"),
}


def _problem(err: ErrorDetails) -> SpecProblem:
    """A pydantic error as a problem whose message says what is wrong and what to write."""
    field, kind, got = _path(err["loc"]), err["type"], err["input"]
    ctx = err.get("ctx", {})
    if kind == "value_error":
        return SpecProblem(field, str(ctx["error"]))
    if kind == "spec_item":
        return SpecProblem(f"{field}[{ctx['item']}]", ctx["message"])
    fix = _FIX.get(re.sub(r"\[[^]]*\]", "", field), _FIX.get(_top(field), "see the JobSpec docs"))
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    if kind == "missing":
        return SpecProblem(field, f"is required; {fix}")
    if kind == "extra_forbidden":
        *parent, key = map(str, err["loc"])
        known = list(Environment.model_fields if parent else JobSpec.model_fields)
        close = [k for k in known if key and k.startswith(key)]
        close = close or difflib.get_close_matches(key, known)
        hint = f"did you mean {close[0]!r}? If not, remove it" if close else "remove it"
        return SpecProblem(field, f"is not a field of {'.'.join(parent) or 'a job spec'}; {hint}")
    if kind == "literal_error":
        close = difflib.get_close_matches(str(got).lower(), get_args(Topology), n=1)
        hint = f"did you mean {close[0]!r}?" if close else fix
        return SpecProblem(field, f"must be one of {ctx['expected']}, got {shown}; {hint}")
    if kind in _EXPECTED:
        what = f"must be {_EXPECTED[kind]}, got {shown}"
        if kind == "int_type" and isinstance(got, float) and got.is_integer():
            fix = f"write {int(got)} (without a decimal point)"
        elif kind in ("int_type", "float_type") and isinstance(got, str) and _numeric(got):
            fix = f"write {got.strip()} without quotes"
        elif kind == "string_type" and _top(field) in ("command", "env") and _number(got):
            fix = f"quote it: '{got}'"
    elif kind in _BOUND:
        words, key = _BOUND[kind]
        what = f"must be {words} {ctx[key]:g}, got {shown}"
    elif kind == "finite_number":
        what = f"must be a finite number, got {shown}"
    else:  # a kind this module does not expect; pydantic's own words
        what = err["msg"][:1].lower() + err["msg"][1:]
    return SpecProblem(field, f"{what}; {fix}")


def _numeric(s: str) -> bool:
    try:
        return math.isfinite(float(s))
    except ValueError:
        return False
