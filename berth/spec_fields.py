"""Checks of single job-spec fields, each with a message that says what is wrong and how to
fix it (`berth.spec` puts them on the model and gathers the problems)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic_core import PydanticCustomError

from scheduling.cluster import TOPOLOGY_CHOICES
from scheduling.mig import profile_problem
from scheduling.resources import gpu_request_problem

# Set by the platform for every replica; a user's value would break the gang or the tracking.
# What the runtimes (runtime/base.py RUNTIME_ENV) and the tracker (tracking/tracker.py
# replica_env) set for every replica; tests/test_spec.py keeps this a superset of both.
RESERVED_ENV = frozenset(
    {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    | {"LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
    | {"BERTH_JOB_ID", "BERTH_ATTEMPT", "BERTH_NODE", "BERTH_GPU_SHARE", "BERTH_CHECKPOINT_DIR"}
    | {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
    | {"MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID"}
    | {"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "MLFLOW_SYSTEM_METRICS_NODE_ID"}
    | {"MLFLOW_ENABLE_ASYNC_LOGGING", "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE"}
    # The platform's (BERTH_SYSTEM_METRICS_INTERVAL_S): every sample costs the MLflow server.
    | {"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"}
)
RESERVED_PREFIX = "BERTH_"  # staging adds BERTH_INPUT_<i>, BERTH_INPUT_<NAME>, ...
Topology = Literal[TOPOLOGY_CHOICES]  # what a job may require (scheduling.cluster)

NAME_RE = re.compile(r"[a-z](?:[-a-z0-9]*[a-z0-9])?")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DNS = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_REPO = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(  # [registry[:port]/]repository[:tag][@digest], as `docker pull` reads it
    rf"(?:(?:(?:{_DNS}(?:\.{_DNS})+|localhost)(?::[0-9]+)?|{_DNS}:[0-9]+)/)?{_REPO}(?:/{_REPO})*"
    r"(?::\w[\w.-]{0,127})?(?:@(?:sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128}))?"
)
_PROJECT = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REQUIREMENT = re.compile(  # PEP 508, roughly: name [extras] (version | @ url) [; marker]
    rf"{_PROJECT}\s*(?:\[[\w\s,.-]*\])?\s*"
    r"(?:@\s*\S+|\(?\s*(?:===|[<>=!~]=|[<>])\s*[^;\s<>=!~][^;]*)?\s*(?:;.*)?"
)
_PYTHON = re.compile(r"3\.[0-9]{1,2}(?:\.[0-9]{1,3})?")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
SPEC_EXAMPLE = (
    "e.g. {name: train-bert, team: vision, image: ..., command: [...], gpus_per_replica: 1}"
)
URI_FIX = "use s3://bucket/key, file:///absolute/path or https://host/path"
ARTIFACT_FIX = "give a path relative to the job's working directory, e.g. 'outputs/model.pt'"


def job_name(v: str) -> str:
    if len(v) <= 63 and NAME_RE.fullmatch(v):
        return v
    slug = re.sub(r"^[^a-z]+", "", re.sub(r"[^a-z0-9]+", "-", v.lower()))[:63].strip("-")
    fix = f"e.g. {slug!r}" if slug else "e.g. 'train-bert'"
    raise ValueError(
        "must be 1-63 lowercase letters, digits or '-', starting with a letter and ending with a "
        f"letter or digit (it names the job's pods), got {v!r}; {fix}"
    )


def non_blank(fix: str) -> Callable[[str], str]:
    def check(v: str) -> str:
        if not v.strip():
            raise ValueError(f"must not be empty; {fix}")
        if v != v.strip():
            raise ValueError(f"must not start or end with spaces, got {v!r}; write {v.strip()!r}")
        return v

    return check


def image_ref(v: str) -> str:
    example = "e.g. 'ghcr.io/org/train:1.2' or 'ghcr.io/org/train@sha256:<64 hex digits>'"
    if not v.strip() or any(c.isspace() for c in v):
        raise ValueError(f"must be one image reference without spaces, got {v!r}; {example}")
    if "://" in v:
        raise ValueError(f"must not have a scheme, got {v!r}; write {v.split('://', 1)[1]!r}")
    if "@" in v and not re.search(r"@(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$", v):
        raise ValueError(
            f"has a malformed digest, got {v!r}; a digest is 'sha256:' and 64 lowercase hex digits"
        )
    if len(v) > 512 or not _IMAGE.fullmatch(v):
        raise ValueError(
            f"is not a container image reference, got {v!r}; write [registry/]repository[:tag] "
            f"with a lowercase repository, {example}"
        )
    return v


def requirement(v: str) -> str:
    example = "e.g. 'torch==2.3.1' or 'pkg @ https://host/pkg.whl'"
    if not v.strip():
        raise ValueError(f"must not be empty; remove it or name a package, {example}")
    if any(c in v for c in "\r\n\x00"):
        # One requirement is one line of requirements.txt: a newline would smuggle in a second
        # line, e.g. '-r /kaniko/.docker/config.json', which pip quotes in its error.
        raise ValueError(f"must be one line, got {v!r}; give each package as its own item")
    if v.lstrip().startswith("-"):
        raise ValueError(
            f"pip options such as '-r file' or '--index-url' are not supported, got {v!r}; "
            f"list each package instead, {example}"
        )
    pinned = re.fullmatch(rf"({_PROJECT})\s*=\s*([^=].*)", v.strip())
    if pinned:
        raise ValueError(
            f"pins a version with '=', got {v!r}; write {'=='.join(pinned.groups())!r}"
        )
    if not _REQUIREMENT.fullmatch(v.strip()):
        raise ValueError(
            f"is not a pip requirement, got {v!r}; write a package name with optional extras, "
            f"version and marker, {example}"
        )
    return v


def python_version(v: str) -> str:
    if not _PYTHON.fullmatch(v):
        raise ValueError(f"must be a Python 3 version, got {v!r}; e.g. '3.11' or '3.11.9'")
    return v


def command_line(v: tuple[str, ...]) -> tuple[str, ...]:
    example = "e.g. ['python', 'train.py', '--epochs', '10']"
    if not v:
        raise ValueError(f"must not be empty; give the program and its arguments, {example}")
    program = v[0]
    if not program.strip():
        item_error(0, f"the program must not be empty; {example}")
    if any(c.isspace() for c in program):
        words = [*program.split(), *v[1:]]
        item_error(
            0,
            f"must be the program alone, got {program!r}; split the words into list items, e.g. "
            f"{words!r}, or run a shell line with ['bash', '-c', {program.strip()!r}]",
        )
    return v


def item_error(index: int, message: str) -> None:
    """A whole-list check that blames one item: `parse_spec` appends `[index]` to the path."""
    raise PydanticCustomError("spec_item", "{message}", {"message": message, "item": index})


def engine_min(unit: int, least: str) -> Callable[[float], float]:
    def check(v: float) -> float:
        if round(v * unit) < 1:
            raise ValueError(f"must be at least {least}, got {v:g}; ask for more")
        return v

    return check


def gpu_request(v: float) -> float:
    problem = gpu_request_problem(v)
    if problem and v <= 0:
        problem += "; Berth runs GPU jobs: run CPU-only work as a plain Airflow task"
    if problem:
        raise ValueError(problem)
    return v


def mig_profile_name(v: str) -> str:
    problem = profile_problem(v)
    if problem:
        raise ValueError(problem)
    return v


def input_uri(v: str) -> str:
    if not v.strip() or any(c.isspace() for c in v):
        raise ValueError(f"must be one URI without spaces (write %20), got {v!r}; {URI_FIX}")
    try:
        parts = urlsplit(v)
    except ValueError as e:
        raise ValueError(f"is not a URI ({e}), got {v!r}; {URI_FIX}") from None
    scheme, host, path = parts.scheme, parts.netloc, parts.path
    if scheme == "s3":
        if not _BUCKET.fullmatch(host):
            raise ValueError(
                "must be s3://bucket/key with a bucket name of 3-63 lowercase letters, digits, "
                f"'.' or '-', got {v!r}; e.g. 's3://my-bucket/data/'"
            )
        if path in ("", "/"):
            raise ValueError(
                f"must name a key or prefix in the bucket, got {v!r}; e.g. 's3://{host}/data/'"
            )
    elif scheme == "file":
        if host or not path.startswith("/"):
            raise ValueError(
                f"must be file:// and an absolute path (three slashes), got {v!r}; "
                "e.g. 'file:///data/train'"
            )
    elif scheme == "https":
        if not parts.hostname:
            raise ValueError(f"must name a host, got {v!r}; e.g. 'https://host/data.tar'")
    elif scheme == "http":
        raise ValueError(f"plain http is not accepted, got {v!r}; use {'https' + v[4:]!r}")
    elif v.startswith("/"):
        raise ValueError(f"a local path needs the file scheme, got {v!r}; write {'file://' + v!r}")
    else:
        got = f"scheme {scheme!r} is not supported" if scheme else "is not a URI"
        raise ValueError(f"{got}, got {v!r}; {URI_FIX}")
    return v


def artifact_path(v: str) -> str:
    if not v.strip():
        raise ValueError(f"must not be empty; {ARTIFACT_FIX}")
    if "://" in v:
        raise ValueError(
            f"must be a path the job writes, not a URI, got {v!r}; Berth logs artifacts to "
            f"MLflow for you: {ARTIFACT_FIX}"
        )
    if v.startswith(("/", "\\", "~")) or re.match(r"[A-Za-z]:[\\/]", v):
        raise ValueError(f"must be a relative path, got {v!r}; {ARTIFACT_FIX}")
    if ".." in re.split(r"[\\/]", v):
        raise ValueError(
            f"must stay inside the working directory (no '..'), got {v!r}; {ARTIFACT_FIX}"
        )
    return v


_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def secret_ref(v: str) -> str:
    """'name/key': a key of a Kubernetes Secret in the team's namespace."""
    example = "e.g. 'hf-token/token' (kubectl -n berth-<team> create secret generic hf-token ...)"
    name, sep, key = v.partition("/")
    if not sep or not name or not key:
        raise ValueError(f"must be '<Secret name>/<key>', got {v!r}; {example}")
    if len(name) > 253 or not _SECRET_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a Secret name (lowercase letters, digits, '-' and '.'); {example}"
        )
    if len(key) > 253 or not _SECRET_KEY.fullmatch(key):
        raise ValueError(
            f"{key!r} is not a Secret key (letters, digits, '-', '_' and '.'); {example}"
        )
    return v


def gpu_models(v: Any) -> Any:
    """`gpu_model`: one model name or a list, in order of preference -> a tuple, each model
    once, stripped (a pydantic before-validator; an empty list or None: any model)."""
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list | tuple):
        return v  # pydantic says what it should be
    out: list[str] = []
    for m in v:
        if not isinstance(m, str) or not m.strip() or "|" in m:
            raise ValueError(
                f"{m!r} is not a GPU model name; give one such as 'H100', or a list such as "
                "['H100', 'A100'] (preferred first), not joined with '|'"
            )
        if m.strip() not in out:
            out.append(m.strip())
    return tuple(out)


def env_key(k: str) -> str:
    if k.startswith(RESERVED_PREFIX):
        raise ValueError(
            f"starts with {RESERVED_PREFIX!r}: such names are set by the platform (job, "
            "attempt, node, staged inputs); rename it"
        )
    if k in RESERVED_ENV:
        others = ", ".join(sorted(RESERVED_ENV - {k}))
        raise ValueError(f"is set by the platform; remove it (the platform also sets {others})")
    if not ENV_KEY_RE.fullmatch(k):
        fix = re.sub(r"^(?=[0-9])", "_", re.sub(r"[^A-Za-z0-9_]", "_", k)) or "MY_VAR"
        raise ValueError(
            f"is not a valid variable name: use letters, digits and '_', not starting with a "
            f"digit; e.g. {fix!r}"
        )
    return k


def recoverable_exit_code(v: int) -> int:
    """An exit code a job declares recoverable: not 0 (success), within what a process can
    return (1..255) or a signal as the local runtime reports it (-1..-64)."""
    if v == 0:
        raise ValueError("0 is success, not a failure to recover from; give codes such as 75")
    if not (-64 <= v <= 255):
        raise ValueError(f"must be an exit code from 1 to 255, or a signal from -1 to -64, got {v}")
    return v
