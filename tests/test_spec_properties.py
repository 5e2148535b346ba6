"""Job specs drawn at random (derandomized, so every run sees the same examples): valid ones
must parse and convert to exact engine units; a valid one with one field broken must be
rejected with problems about that field only; an oversize one must be rejected by
`check_spec` naming the field to change. The hand-written cases are in test_spec.py."""

from __future__ import annotations

import json
from typing import Any

from builders import cluster, teams
from hypothesis import given, settings
from hypothesis import strategies as st
from test_spec import CLUSTER, DIGEST, DROP, INF, NAN, PROPERTY, TEAMS, problems_of, spec

from berth.spec import check_spec, parse_spec
from berth.spec_fields import RESERVED_ENV
from scheduling.admission import check_job
from scheduling.cluster import TOPOLOGY_CHOICES
from scheduling.resources import Resources

LOWER, DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"
PATHS = st.lists(st.text(LOWER + DIGITS + "_", min_size=1, max_size=6), min_size=1, max_size=3)
NAMES = st.builds(
    lambda first, rest: first + rest.rstrip("-"),
    st.sampled_from(LOWER),
    st.text(LOWER + DIGITS + "-", max_size=20),
)
IMAGES = st.sampled_from(
    [
        "ghcr.io/org/train:1.2",
        f"ghcr.io/org/train@{DIGEST}",
        "nvcr.io/nvidia/pytorch:24.01-py3",
        "localhost:5000/team/job",
        "python:3.11-slim",
        "ubuntu",
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/bert_v2:latest",
    ]
)
REQUIREMENTS = st.sampled_from(
    [
        "numpy",
        "torch==2.3.1",
        "transformers[torch]>=4.40,<5",
        "scikit-learn~=1.4",
        "mypkg @ https://h.io/mypkg-1.0-py3-none-any.whl",
        "flash-attn>=2.5 ; platform_machine == 'x86_64'",
    ]
)
ENVIRONMENTS = st.fixed_dictionaries(
    {"requirements": st.lists(REQUIREMENTS, max_size=3)},
    optional={"python": st.sampled_from(["3.10", "3.11", "3.12.4"])},
)
WORDS = st.text(st.characters(codec="utf-8"), max_size=8)
COMMANDS = st.builds(
    lambda p, rest: [p, *rest],
    st.text(LOWER + "/._-", min_size=1, max_size=12),
    st.lists(WORDS, max_size=4),
)
URIS = st.builds(
    lambda scheme, host, path: f"{scheme}{host}/{'/'.join(path)}",
    st.sampled_from(["s3://", "https://"]),
    st.sampled_from(["data-bucket", "ml.example.com", "b01"]),
    PATHS,
) | PATHS.map(lambda path: "file:///" + "/".join(path))
ARTIFACTS = PATHS.map("/".join)
ENV_KEYS = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from(LOWER.upper() + "_"),
    st.text(LOWER.upper() + DIGITS + "_", max_size=10),
).filter(lambda k: k not in RESERVED_ENV)
# (spec value, milli-GPUs it must become): whole GPUs, or a share of one in thousandths
GPUS = st.one_of(
    st.integers(1, 16).map(lambda g: (g, g * 1000)),
    st.integers(1, 999).map(lambda m: (m / 1000, m)),
)
POSITIVE = st.floats(0.001, 1e4, allow_nan=False, allow_infinity=False)


@st.composite
def valid_specs(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """A valid spec (as a user writes it) and the milli-GPUs per replica it asks for."""
    gpus, milli = draw(GPUS)
    data: dict[str, Any] = {
        "name": draw(NAMES),
        "team": draw(st.sampled_from(["a", "b", "vision"])),
        "command": draw(COMMANDS),
        "gpus_per_replica": gpus,
    }
    if draw(st.booleans()):
        data["image"] = draw(IMAGES)
    else:
        data["environment"] = draw(ENVIRONMENTS)
    optional = {
        "experiment": st.none() | st.sampled_from(["bert", "sweep 3/lr"]),
        "replicas": st.integers(1, 64),
        "cpus_per_replica": POSITIVE,
        "memory_gb_per_replica": POSITIVE,
        "topology": st.sampled_from(TOPOLOGY_CHOICES),
        "priority": st.integers(-1000, 1000),
        "preemptible": st.booleans(),
        "retries": st.integers(0, 20),
        "retry_backoff_s": st.floats(0.001, 3600),  # at most the default retry_backoff_max_s
        "time_limit_s": st.none() | POSITIVE,
        "inputs": st.lists(URIS, max_size=3),
        "artifacts": st.lists(ARTIFACTS, max_size=3),
        "env": st.dictionaries(ENV_KEYS, WORDS, max_size=3),
    }
    for key, values in optional.items():
        if draw(st.booleans()):
            data[key] = draw(values)
    if draw(st.booleans()):
        base = data.get("retry_backoff_s", 30.0)
        data["retry_backoff_max_s"] = base * draw(st.floats(1, 100))
    return data, milli


WIDE = cluster(nodes=4, gpus=16, groups=4, cpus=1024, memory_gb=1e5, per_rack=2, racks_per_block=2)
WIDE_TEAMS = teams(a=8, b=8)


@PROPERTY
@given(valid_specs())
def test_valid_specs_parse_and_convert_to_exact_engine_units(drawn: tuple[dict[str, Any], int]):
    data, milli = drawn
    s = parse_spec(data)
    job = s.to_job("j", 1.0)
    replicas = data.get("replicas", 1)
    cpu = round(data.get("cpus_per_replica", 1) * 1000)
    mem = round(data.get("memory_gb_per_replica", 4) * 1024)
    assert job.per_replica == Resources(milli, cpu, mem)
    assert job.demand == Resources(replicas * milli, replicas * cpu, replicas * mem)
    assert job.shared == (milli < 1000) and job.whole_gpus == milli // 1000
    assert parse_spec(json.loads(s.model_dump_json())) == s
    # What the spec lets through, admission never calls invalid (it may not fit, or the team
    # may be unknown, but the request itself is well formed).
    rejection = check_job(job, WIDE, WIDE_TEAMS)
    assert rejection is None or rejection.reason != "invalid", rejection


BAD_VALUES: dict[str, list[Any]] = {
    "name": ["", "Train", "1abc", "a_b", "a" * 64, "abc-", "a b", 5, None, DROP],
    "team": ["", "  ", " a", 7, None, ["a"], DROP],
    "experiment": ["", " x", 3, ["x"]],
    "image": [
        "",
        "Org/Train",
        "ghcr.io/org/train:",
        "train@sha256:abc",
        "docker://ghcr.io/o/t",
        "a b",
        42,
    ],
    "command": [[], "python train.py", [""], ["  "], ["python train.py"], [1], None, DROP],
    "replicas": [0, -1, 1.5, 2.0, True, "2", None],
    "gpus_per_replica": [0, -1, 1.5, 0.0004, 0.9996, INF, NAN, True, "1", None, DROP],
    "cpus_per_replica": [0, -1, 0.0004, INF, NAN, "2", True, None],
    "memory_gb_per_replica": [0, -4, 0.0001, INF, NAN, "4Gi", None],
    "topology": ["racks", "", "cluster", "Node", 1, None],
    "priority": [1001, -1001, 1.5, "high", True, None],
    "preemptible": ["yes", "true", 1, 0, None],
    "retries": [-1, 21, 2.0, "3", True, None],
    "retry_backoff_s": [0, -1, INF, NAN, "30s", None],
    "retry_backoff_max_s": [0, -1, INF, NAN, "1h", None, "below retry_backoff_s"],
    "time_limit_s": [0, -5, INF, NAN, "1h", True],
    "inputs": ["s3://bkt/k", [None], {"a": "s3://bkt/k"}],
    "artifacts": ["out", [3]],
    "env": [["A=1"], {"SEED": 42}, {"SEED": None}],
}
BAD_ITEMS = {
    "inputs": ["gs://b/k", "s3://bkt", "s3://Bkt/k", "/data/x", "data/x", "http://h/x", "", "x y"],
    "artifacts": ["/abs", "../up", "a/../../b", "", "s3://b/k", "C:\\out", "~/out"],
}
BAD_ENVIRONMENTS = [
    "torch",
    {"requirements": "torch"},
    {"requirements": ["torch 2"]},
    {"requirements": ["-e ."]},
    {"requirements": ["git+https://h/x"]},
    {"python": 3.1},
    {"python": "2.7"},
    {"python": "three"},
    {"pip": ["x"]},
]


@st.composite
def broken_specs(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A valid spec with one field broken, and the field path the problems must be under."""
    data, _ = draw(valid_specs())
    how = draw(st.sampled_from([*BAD_VALUES, *BAD_ITEMS, "env key", "environment", "unknown"]))
    if how in BAD_ITEMS:  # one bad item among good ones: the path names its index
        items = list(data.get(how, []))
        at = draw(st.integers(0, len(items)))
        items.insert(at, draw(st.sampled_from(BAD_ITEMS[how])))
        data[how] = items
        return data, f"{how}[{at}]"
    if how == "env key":
        key = draw(st.sampled_from([*sorted(RESERVED_ENV), "1X", "A-B", "", "a.b"]))
        data["env"] = {**data.get("env", {}), key: "1"}
        return data, "env"
    if how == "environment":  # a broken environment instead of the image (or environment)
        data.pop("image", None)
        data["environment"] = draw(st.sampled_from(BAD_ENVIRONMENTS))
        return data, "environment"
    if how == "unknown":
        key = draw(st.sampled_from(["gpus", "replica", "memory", "cmd", "Name", "timeout"]))
        data[key] = 1
        return data, key
    if how == "image" and draw(st.booleans()):  # neither or both
        if "image" in data:
            data.pop("image")
        else:
            data["image"] = draw(IMAGES)
        return data, "image"
    bad = draw(st.sampled_from(BAD_VALUES[how]))
    if bad == "below retry_backoff_s":
        bad = data.get("retry_backoff_s", 30.0) / 2
    if bad is DROP:
        data.pop(how, None)
    else:
        data[how] = bad
    return data, how


@settings(PROPERTY, max_examples=400)
@given(broken_specs())
def test_a_broken_field_is_always_rejected_and_named(drawn: tuple[dict[str, Any], str]):
    data, field = drawn
    problems = problems_of(data)
    assert problems
    for p in problems:
        assert p.field == field or p.field.startswith((f"{field}.", f"{field}[")), (field, p)
        assert ";" in p.message  # what is wrong; how to fix it


@st.composite
def oversize_specs(draw: st.DrawFn) -> tuple[dict[str, Any], str, bool]:
    """A spec that never fits CLUSTER/TEAMS, the field to change, and whether quotas apply."""
    kind = draw(st.sampled_from(["team", "topology", "gpus", "quota", "gang", "cpus", "memory"]))
    if kind == "team":
        return spec(team=draw(st.sampled_from(["nlp", "A", "vision"]))), "team", True
    if kind == "topology":
        return spec(topology=draw(st.sampled_from(["rack", "block"]))), "topology", True
    if kind == "gpus":  # more than a node has, within the quota
        return spec(gpus_per_replica=draw(st.integers(9, 12))), "gpus_per_replica", False
    if kind == "quota":  # fits the cluster, not team a's 12 GPUs
        gpus = draw(st.integers(1, 4))
        replicas = draw(st.integers(12 // gpus + 1, 16 // gpus))
        return spec(replicas=replicas, gpus_per_replica=gpus), "replicas", True
    if kind == "gang":  # more than the cluster's 16 GPUs
        gpus = draw(st.integers(1, 8))
        replicas = draw(st.integers(16 // gpus + 1, 40))
        return spec(replicas=replicas, gpus_per_replica=gpus), "replicas", False
    # CPUs or memory beyond a node's. admission.check_job names `replicas` for a gang and
    # `gpus_per_replica` otherwise, even when CPUs or memory are what does not fit.
    replicas = draw(st.integers(1, 3))
    field = "replicas" if replicas > 1 else "gpus_per_replica"
    if kind == "cpus":
        return spec(replicas=replicas, cpus_per_replica=draw(st.floats(64.01, 1e4))), field, False
    memory = draw(st.floats(512.01, 1e6))
    return spec(replicas=replicas, memory_gb_per_replica=memory), field, False


@PROPERTY
@given(oversize_specs(), st.booleans())
def test_check_spec_rejects_what_never_fits_naming_a_field(
    drawn: tuple[dict[str, Any], str, bool], shrink: bool
):
    data, field, quota_only = drawn
    s = parse_spec(data)
    error = check_spec(s, CLUSTER, TEAMS)
    # One field to change (a gang over both the quota and the cluster is told both, on it).
    assert error is not None and {p.field for p in error.problems} == {field}
    assert str(error).startswith(f"{field}: ")
    if quota_only:
        return
    assert check_spec(s, CLUSTER, TEAMS, quotas=False) is not None  # too big, not just over quota
    if shrink:  # the same spec, one replica of a node's share, fits
        one = {"replicas": 1, "gpus_per_replica": 1.0, "cpus_per_replica": 1.0}
        small = s.model_copy(update={**one, "memory_gb_per_replica": 4.0})
        assert check_spec(small, CLUSTER, TEAMS) is None
