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

from berth.spec_fields import Topology

# A spec given as this string is read from the DAG run's params when the task runs.
FROM_PARAMS = "params"


def job_params(teams: list[str], default_command: list[str]) -> dict[str, Param]:
    """Params for every JobSpec field a UI user needs; `teams` is the team enum."""
    return {
        "name": Param("train-demo", type="string", description="Job name (lowercase, '-')."),
        "team": Param(teams[0], type="string", enum=teams, description="Your team (quota)."),
        "command": Param(
            default_command,
            type="array",
            items={"type": "string"},
            description="Program and arguments, one per line, e.g. python / train.py.",
        ),
        "requirements": Param(
            [],
            type="array",
            items={"type": "string"},
            description="pip requirements of the job's environment (leave empty with an image).",
        ),
        "python": Param(None, type=["null", "string"], description="Python version, e.g. 3.11."),
        "image": Param(
            None, type=["null", "string"], description="Container image instead of requirements."
        ),
        "replicas": Param(1, type="integer", minimum=1, description="Replicas in the gang."),
        "gpus_per_replica": Param(
            1, type="number", exclusiveMinimum=0, description="Whole GPUs, or a share like 0.25."
        ),
        "cpus_per_replica": Param(1, type="number", exclusiveMinimum=0),
        "memory_gb_per_replica": Param(4, type="number", exclusiveMinimum=0),
        "topology": Param("any", type="string", enum=list(get_args(Topology))),
        "priority": Param(0, type="integer", minimum=-1000, maximum=1000),
        "retries": Param(0, type="integer", minimum=0, maximum=20),
        "retry_backoff_s": Param(30, type="number", exclusiveMinimum=0),
        "preemptible": Param(True, type="boolean"),
        "time_limit_s": Param(None, type=["null", "number"]),
        "inputs": Param(
            [], type="array", items={"type": "string"}, description="file:///... inputs."
        ),
        "artifacts": Param(
            [], type="array", items={"type": "string"}, description="Paths the job writes."
        ),
        "env": Param({}, type="object", description="Extra environment, e.g. {SEED: '1'}."),
        "register_model": Param(
            None,
            type=["null", "object"],
            description="Register the model in MLflow: {name: ..., path: model}.",
        ),
    }


def spec_from_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A spec mapping from a run's params; unknown keys go through, so parse_spec names them."""
    spec = {k: v for k, v in params.items() if v is not None}
    reqs = spec.pop("requirements", [])
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
