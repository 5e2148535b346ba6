"""Job specs: what an ML engineer writes, each problem named with its field path and its fix.

Hand-written cases; specs drawn at random are in test_spec_properties.py. Both files run in a
few seconds.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from builders import cluster, teams
from hypothesis import settings
from pydantic import ValidationError

from berth.spec import JobSpec, SpecError, SpecProblem, check_spec, parse_spec
from berth.spec_fields import RESERVED_ENV
from scheduling.jobs import Job
from scheduling.resources import Resources

PROPERTY = settings(derandomize=True, deadline=None, database=None, max_examples=150)
DIGEST = "sha256:" + "0123456789abcdef" * 4
DROP = object()  # a value for `spec()`: leave the field out
INF, NAN = float("inf"), float("nan")


def spec(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "train-bert",
        "team": "a",
        "image": "ghcr.io/org/train:1.2",
        "command": ["python", "train.py"],
        "gpus_per_replica": 1,
    }
    data.update(changes)
    return {k: v for k, v in data.items() if v is not DROP}


def problems_of(data: Any) -> list[SpecProblem]:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return info.value.problems


# --- valid specs -------------------------------------------------------------------------------


def test_full_spec_parses_and_converts_to_engine_units():
    s = parse_spec(
        spec(
            experiment="bert-sweeps",
            image=f"ghcr.io/org/train:1.2@{DIGEST}",
            command=["torchrun", "--nproc-per-node", "1", "train.py"],
            replicas=4,
            gpus_per_replica=0.25,
            cpus_per_replica=8,
            memory_gb_per_replica=32,
            topology="node",
            priority=10,
            preemptible=False,
            retries=3,
            retry_backoff_s=10,
            retry_backoff_max_s=60,
            time_limit_s=86400,
            inputs=["s3://data-bucket/bert/", "file:///mnt/shared/vocab.txt", "https://h.io/x.tar"],
            artifacts=["outputs/model.pt", "./logs"],
            env={"SEED": "42", "HF_HOME": "/cache"},
        )
    )
    assert s.command == ("torchrun", "--nproc-per-node", "1", "train.py")
    assert s.env == {"SEED": "42", "HF_HOME": "/cache"}
    job = s.to_job("job-7", 5.0)
    assert job == Job(
        id="job-7",
        team="a",
        replicas=4,
        gpu=250,
        cpu=8000,
        mem=32 * 1024,
        priority=10,
        topology="node",
        preemptible=False,
        submit_time=5.0,
        time_limit_s=86400.0,  # the engine's EASY backfill reads it
    )
    assert job.shared and job.demand == Resources(1000, 32_000, 4 * 32 * 1024)


def test_defaults_are_the_documented_ones():
    s = parse_spec(spec())
    assert (s.replicas, s.cpus_per_replica, s.memory_gb_per_replica) == (1, 1.0, 4.0)
    assert (s.topology, s.priority, s.preemptible, s.experiment) == ("any", 0, True, None)
    assert (s.retries, s.retry_backoff_s, s.retry_backoff_max_s, s.time_limit_s) == (
        0,
        30.0,
        3600.0,
        None,
    )
    assert s.inputs == () and s.artifacts == () and s.env == {} and s.environment is None
    job = s.to_job("j", 0.0)
    assert (job.gpu, job.cpu, job.mem, job.whole_gpus, job.shared) == (1000, 1000, 4096, 1, False)


def test_environment_instead_of_an_image():
    s = parse_spec(
        spec(
            image=DROP,
            environment={"requirements": ["torch==2.3.1", "transformers[torch]>=4.40,<5"]},
        )
    )
    assert s.image is None and s.environment is not None
    assert s.environment.requirements == ("torch==2.3.1", "transformers[torch]>=4.40,<5")
    assert s.environment.python is None


def test_round_trips_through_dump_and_json():
    s = parse_spec(spec(environment={"python": "3.11"}, image=DROP, inputs=["s3://bkt/k"]))
    assert parse_spec(s.model_dump()) == s
    assert parse_spec(json.loads(s.model_dump_json())) == s


def test_spec_is_frozen():
    s = parse_spec(spec())
    with pytest.raises(ValidationError):
        s.replicas = 2  # type: ignore[misc]
    assert isinstance(s.command, tuple)


def test_backoff_doubles_from_the_first_retry_and_is_capped():
    s = parse_spec(spec(retries=5, retry_backoff_s=30, retry_backoff_max_s=100))
    assert [s.backoff_s(a) for a in range(1, 6)] == [30, 60, 100, 100, 100]
    assert s.backoff_s(5000) == 100  # 2**4999 would overflow a float
    with pytest.raises(ValueError, match="from 1"):
        s.backoff_s(0)


# --- one rule, one problem: field path and a message that names the fix -------------------------

RULES = [
    # (changes, field, fragments of the message: what is wrong, then how to fix it)
    ({"name": "Train_BERT"}, "name", ["lowercase", "'train-bert'"]),
    ({"name": "bert-"}, "name", ["ending with a letter or digit", "e.g. 'bert'"]),
    ({"name": "a" * 64}, "name", ["1-63", "e.g. '" + "a" * 63 + "'"]),
    ({"name": DROP}, "name", ["is required", "'train-bert'"]),
    ({"team": ""}, "team", ["must not be empty", "teams.yaml"]),
    ({"team": " vision"}, "team", ["spaces", "write 'vision'"]),
    ({"experiment": ""}, "experiment", ["must not be empty", "DAG id"]),
    ({"image": "ghcr.io/Org/train"}, "image", ["lowercase", "'ghcr.io/org/train:1.2'"]),
    ({"image": "docker://ghcr.io/o/t:1"}, "image", ["scheme", "write 'ghcr.io/o/t:1'"]),
    ({"image": "ghcr.io/o/t@sha256:abc"}, "image", ["malformed digest", "64 lowercase hex"]),
    ({"image": DROP}, "image", ["neither image nor environment", "give exactly one"]),
    ({"environment": {}}, "image", ["both image and environment", "give exactly one"]),
    (
        {"image": DROP, "environment": {"requirements": ["numpy", "torch=2.1"]}},
        "environment.requirements[1]",
        ["'='", "write 'torch==2.1'"],
    ),
    (
        {"image": DROP, "environment": {"requirements": ["-r requirements.txt"]}},
        "environment.requirements[0]",
        ["pip options", "list each package"],
    ),
    (  # a second line would reach requirements.txt (and pip's error quotes what it reads)
        {"image": DROP, "environment": {"requirements": ["torch>=1\n-r /kaniko/.docker/x"]}},
        "environment.requirements[0]",
        ["must be one line", "its own item"],
    ),
    (
        {"image": DROP, "environment": {"requirements": ["torch 2.1"]}},
        "environment.requirements[0]",
        ["not a pip requirement", "'torch==2.3.1'"],
    ),
    (
        {"image": DROP, "environment": {"python": 3.1}},
        "environment.python",
        ["must be a string", "quote the version"],
    ),
    (
        {"image": DROP, "environment": {"python": "2.7"}},
        "environment.python",
        ["Python 3", "'3.11'"],
    ),
    (
        {"image": DROP, "environment": {"pip": ["torch"]}},
        "environment.pip",
        ["not a field of environment", "remove it"],
    ),
    ({"command": []}, "command", ["must not be empty", "['python', 'train.py'"]),
    ({"command": "python train.py"}, "command", ["must be a list", "['python', 'train.py']"]),
    ({"command": ["", "x"]}, "command[0]", ["must not be empty", "['python', 'train.py'"]),
    (
        {"command": ["python train.py", "--lr", "1"]},
        "command[0]",
        ["program alone", "['python', 'train.py', '--lr', '1']", "['bash', '-c'"],
    ),
    ({"command": ["python", 3]}, "command[1]", ["must be a string", "quote it: '3'"]),
    ({"replicas": 0}, "replicas", ["at least 1, got 0", "e.g. 4"]),
    ({"replicas": True}, "replicas", ["whole number, got True", "e.g. 4"]),
    ({"replicas": 2.0}, "replicas", ["whole number", "write 2"]),
    (
        {"gpus_per_replica": 1.5},
        "gpus_per_replica",
        ["must be a whole number >= 1 or a fraction below 1 (e.g. 0.25), got 1.5", "1 or 2"],
    ),
    ({"gpus_per_replica": 0}, "gpus_per_replica", ["more than 0", "GPU jobs", "0.25"]),
    ({"gpus_per_replica": 0.0001}, "gpus_per_replica", ["0.001 to 0.999", "e.g. 0.25"]),
    ({"gpus_per_replica": INF}, "gpus_per_replica", ["finite", "0.25"]),
    ({"gpus_per_replica": "1"}, "gpus_per_replica", ["must be a number", "without quotes"]),
    ({"gpus_per_replica": DROP}, "gpus_per_replica", ["is required", "0.25"]),
    ({"cpus_per_replica": 0}, "cpus_per_replica", ["more than 0, got 0", "e.g. 8"]),
    ({"cpus_per_replica": 0.0001}, "cpus_per_replica", ["at least 0.001 CPU", "ask for more"]),
    ({"memory_gb_per_replica": NAN}, "memory_gb_per_replica", ["finite", "e.g. 32"]),
    ({"topology": "Node"}, "topology", ["must be one of", "did you mean 'node'"]),
    ({"topology": "cluster"}, "topology", ["must be one of", "'any' lets Berth choose"]),
    ({"priority": 5000}, "priority", ["at most 1000, got 5000", "-1000 to 1000"]),
    ({"preemptible": "yes"}, "preemptible", ["true or false", "write true"]),
    ({"retries": 21}, "retries", ["at most 20", "from 0 to 20"]),
    ({"retry_backoff_s": -1}, "retry_backoff_s", ["more than 0", "e.g. 30"]),
    (
        {"retry_backoff_max_s": 10},
        "retry_backoff_max_s",
        ["at least retry_backoff_s (30), got 10", "raise retry_backoff_max_s or lower"],
    ),
    (
        {"retry_backoff_s": 7200},
        "retry_backoff_max_s",
        ["at least retry_backoff_s (7200), got 3600", "raise retry_backoff_max_s or lower"],
    ),
    ({"retry_backoff_max_s": -1}, "retry_backoff_max_s", ["more than 0, got -1", "e.g. 3600"]),
    ({"time_limit_s": 0}, "time_limit_s", ["more than 0", "leave it out"]),
    ({"recoverable_exit_codes": [75, 0]}, "recoverable_exit_codes[1]", ["0 is success", "75"]),
    ({"recoverable_exit_codes": [256]}, "recoverable_exit_codes[0]", ["1 to 255", "got 256"]),
    ({"recoverable_exit_codes": [-65]}, "recoverable_exit_codes[0]", ["-1 to -64"]),
    ({"recoverable_exit_codes": ["75"]}, "recoverable_exit_codes[0]", ["whole number"]),
    ({"recoverable_exit_codes": 75}, "recoverable_exit_codes", ["a list", "e.g. [75]"]),
    (
        {"inputs": ["s3://bkt/a", "https://h.io/b", "gs://bkt/c"]},
        "inputs[2]",
        ["scheme 'gs' is not supported", "s3://bucket/key"],
    ),
    ({"inputs": ["/data/x"]}, "inputs[0]", ["file scheme", "write 'file:///data/x'"]),
    ({"inputs": ["http://h.io/x"]}, "inputs[0]", ["plain http", "use 'https://h.io/x'"]),
    ({"inputs": ["file://data/x"]}, "inputs[0]", ["three slashes", "'file:///data/train'"]),
    ({"inputs": ["s3://bkt"]}, "inputs[0]", ["key or prefix", "'s3://bkt/data/'"]),
    ({"inputs": ["s3://My_Bucket/k"]}, "inputs[0]", ["s3://bucket/key", "3-63 lowercase"]),
    ({"inputs": "s3://bkt/k"}, "inputs", ["must be a list", "s3://bucket/key"]),
    ({"artifacts": ["/out/model.pt"]}, "artifacts[0]", ["relative", "'outputs/model.pt'"]),
    ({"artifacts": ["a", "out/../../etc"]}, "artifacts[1]", ["'..'", "relative to"]),
    ({"artifacts": ["s3://b/k"]}, "artifacts[0]", ["not a URI", "MLflow"]),
    ({"env": {"RANK": "0"}}, "env.RANK", ["set by the platform", "remove it"]),
    ({"env": {"1X": "a"}}, "env['1X']", ["not a valid variable name", "e.g. '_1X'"]),
    ({"env": {"SEED": 42}}, "env.SEED", ["must be a string", "quote it: '42'"]),
    ({"gpus": 2}, "gpus", ["not a field of a job spec", "did you mean 'gpus_per_replica'"]),
]


@pytest.mark.parametrize(("changes", "field", "fragments"), RULES, ids=[r[1] for r in RULES])
def test_each_rule_names_the_field_and_the_fix(
    changes: dict[str, Any], field: str, fragments: list[str]
):
    [problem] = problems_of(spec(**changes))
    assert problem.field == field
    for fragment in fragments:
        assert fragment in problem.message
    assert str(problem) == f"{field}: {problem.message}"


@pytest.mark.parametrize("key", sorted(RESERVED_ENV))
def test_every_reserved_variable_is_refused(key: str):
    [problem] = problems_of(spec(env={"OK": "1", key: "x"}))
    assert problem.field == f"env.{key}" and "set by the platform" in problem.message


def test_a_spec_must_be_a_mapping():
    [problem] = problems_of(["name", "x"])
    assert problem.field == "" and str(problem).startswith("(spec): must be a mapping")


def test_all_problems_are_reported_at_once_in_field_order():
    with pytest.raises(SpecError) as info:
        parse_spec(
            spec(
                name="Bad Name",
                environment={"requirements": [""]},  # also: both image and environment
                command=[],
                gpus_per_replica=2.5,
                priority="high",
                inputs=["s3://bkt/k", "ftp://h/x"],
                env={"WORLD_SIZE": "8"},
                replica=3,
            )
        )
    fields = [p.field for p in info.value.problems]
    assert fields == [
        "name",
        "image",
        "environment.requirements[0]",
        "command",
        "gpus_per_replica",
        "priority",
        "inputs[1]",
        "env.WORLD_SIZE",
        "replica",
    ]
    lines = str(info.value).splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == fields


def test_cross_field_rules_are_checked_on_an_otherwise_valid_spec_too():
    fields = [p.field for p in problems_of(spec(image=DROP, retry_backoff_max_s=1))]
    assert fields == ["image", "retry_backoff_max_s"]


def test_direct_construction_enforces_the_same_rules():
    with pytest.raises(ValidationError, match="neither image nor environment"):
        JobSpec(name="x", team="a", command=["p"], gpus_per_replica=1)  # type: ignore[arg-type]


def test_spec_error_survives_pickling():
    with pytest.raises(SpecError) as info:
        parse_spec(spec(name="X", replicas=0))
    again = pickle.loads(pickle.dumps(info.value))
    assert again.problems == info.value.problems and str(again) == str(info.value)


# --- against a cluster ---------------------------------------------------------------------------

CLUSTER = cluster(nodes=2, gpus=8, groups=2, cpus=64, memory_gb=512)  # 2 nodes x 2 groups of 4
TEAMS = teams(a={"nominal": 12, "borrowing_limit": 0}, b=4)  # a may hold 12 GPUs


def test_check_spec_accepts_what_fits_and_names_the_field_of_what_never_will():
    assert check_spec(parse_spec(spec(replicas=3, gpus_per_replica=4)), CLUSTER, TEAMS) is None
    unknown = check_spec(parse_spec(spec(team="nlp")), CLUSTER, TEAMS)
    assert unknown is not None and str(unknown) == "team: unknown team 'nlp'; known teams: a, b"
    rack = check_spec(parse_spec(spec(topology="rack")), CLUSTER, TEAMS)
    assert rack is not None and rack.problems[0].field == "topology"
    assert "use one of: any, gpu_group, node" in rack.problems[0].message
    quota = parse_spec(spec(replicas=4, gpus_per_replica=4))
    over = check_spec(quota, CLUSTER, TEAMS)
    assert over is not None and over.problems[0].field == "replicas"
    assert "raise the team's quota" in str(over)
    assert check_spec(quota, CLUSTER, TEAMS, quotas=False) is None
    # Over its team's quota and too big for any node: both told, so both are fixed at once.
    both = check_spec(parse_spec(spec(gpus_per_replica=16)), CLUSTER, TEAMS)
    assert both is not None and [p.field for p in both.problems] == [
        "replicas",  # a may hold 12 GPUs
        "gpus_per_replica",  # a node has 8
    ]
    assert "may hold at most 12" in str(both) and "does not fit in any one" in str(both)


def test_reserved_env_covers_what_the_platform_sets(tmp_path) -> None:
    from berth.runtime.base import RUNTIME_ENV
    from berth.tracking import AttemptRun, JobTracker

    tracker = JobTracker("http://127.0.0.1:9", tmp_path)  # no server needed to build the env
    tracked = tracker.attempt_env(AttemptRun("1", "p", "r", 1))
    assert RUNTIME_ENV <= RESERVED_ENV
    assert set(tracked) <= RESERVED_ENV


def test_the_platform_prefix_is_refused():
    [problem] = problems_of(spec(env={"BERTH_INPUT_TRAIN": "x"}))
    assert problem.field == "env.BERTH_INPUT_TRAIN" and "'BERTH_'" in problem.message


@pytest.mark.parametrize(
    ("value", "want"),
    [("H100", ("H100",)), ([" H100", "A100", "H100"], ("H100", "A100")), (None, ()), ([], ())],
)
def test_gpu_model_is_a_name_or_a_list_preferred_first(value: Any, want: tuple) -> None:
    data = {"name": "x", "team": "a", "image": "ghcr.io/o/t:1", "command": ["python", "t.py"],
            "gpus_per_replica": 1, "gpu_model": value}  # fmt: skip
    assert parse_spec(data).gpu_model == want


@pytest.mark.parametrize("bad", ["H100|A100", [""], ["H100", 5], 5])
def test_a_bad_gpu_model_names_the_field(bad: Any) -> None:
    data = {"name": "x", "team": "a", "image": "ghcr.io/o/t:1", "command": ["python", "t.py"],
            "gpus_per_replica": 1, "gpu_model": bad}  # fmt: skip
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert err.value.problems[0].field == "gpu_model"
