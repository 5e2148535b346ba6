"""Artifact collection from a job's working directory: locally, and to moto's S3 server over
HTTP (read back with boto3 and compared by sha256), by the library and as the platform's
BERTH_ARTIFACTS_S3_PREFIX setting. Nothing is mocked."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from s3server import S3Server

from berth.settings import BerthSettings
from berth.settings import settings as berth_settings
from berth.staging import ArtifactError, ArtifactManifest, collect_artifacts
from operators.staging import collect_attempt


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


JOB_OUTPUT = {
    "model.pt": b"weights" * 1000,
    "logs/train.log": b"epoch 1\nepoch 2\n",
    "logs/gpu/0.txt": b"util 97%",
    "checkpoints/ep1.pt": b"c1",
    "checkpoints/ep2.pt": b"c2",
    "checkpoints/notes.md": b"not a checkpoint",
    "scratch/tmp.bin": b"not collected",
}


def test_files_directories_and_globs_are_collected_with_a_manifest(tmp_path: Path) -> None:
    work, dest = tmp_path / "work", tmp_path / "out"
    write(work, JOB_OUTPUT)
    patterns = ["model.pt", "logs", "checkpoints/*.pt", "eval/metrics.json"]
    manifest = collect_artifacts(work, patterns, dest)

    expected = {k: v for k, v in JOB_OUTPUT.items() if not k.startswith(("scratch", "checkp"))}
    expected |= {"checkpoints/ep1.pt": b"c1", "checkpoints/ep2.pt": b"c2"}
    assert {f.path: (f.size, f.sha256) for f in manifest.files} == {
        rel: (len(data), sha(data)) for rel, data in expected.items()
    }
    for rel, data in expected.items():
        assert (dest / rel).read_bytes() == data
    assert not (dest / "scratch").exists() and not (dest / "checkpoints" / "notes.md").exists()
    assert manifest.missing == ("eval/metrics.json",)  # listed, not an error
    assert manifest.total_bytes == sum(map(len, expected.values()))
    assert ArtifactManifest.read(dest) == manifest
    assert json.loads((dest / "manifest.json").read_text())["missing"] == ["eval/metrics.json"]


def test_a_failed_attempt_is_collected_as_far_as_it_got(tmp_path: Path) -> None:
    work, dest = tmp_path / "work", tmp_path / "out"
    write(work, {"ckpt/step-100.pt": b"partial", "logs/stderr.txt": b"CUDA error: out of memory"})
    outside = tmp_path / "host-secret"
    outside.write_bytes(b"not the job's")
    (work / "logs" / "escape.txt").symlink_to(outside)
    (work / "ckpt" / "latest.pt").symlink_to(work / "ckpt" / "step-100.pt")  # inside: copied
    unreadable = work / "logs" / "locked.txt"
    unreadable.write_bytes(b"x")
    unreadable.chmod(0)

    manifest = collect_artifacts(work, ["model.pt", "ckpt", "logs"], dest)
    paths = {f.path for f in manifest.files}
    assert {"ckpt/step-100.pt", "ckpt/latest.pt", "logs/stderr.txt"} <= paths
    assert (dest / "ckpt" / "latest.pt").read_bytes() == b"partial"
    assert manifest.missing == ("model.pt",)
    skipped = {s.path: s.reason for s in manifest.skipped}
    assert skipped["logs/escape.txt"] == "links outside the working directory"
    assert not (dest / "logs" / "escape.txt").exists()
    if os.geteuid() != 0:  # root reads anything
        assert skipped["logs/locked.txt"].startswith("cannot be read")


def test_a_working_directory_that_was_never_created_yields_an_empty_manifest(tmp_path) -> None:
    manifest = collect_artifacts(tmp_path / "never", ["model.pt", "logs/*"], tmp_path / "out")
    assert manifest.files == () and manifest.missing == ("model.pt", "logs/*")
    assert ArtifactManifest.read(tmp_path / "out" / "manifest.json") == manifest


def test_bad_arguments_name_the_field_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"patterns\[1\] '\.\./etc' must stay inside"):
        collect_artifacts(tmp_path, ["ok", "../etc"], tmp_path / "out")
    with pytest.raises(ValueError, match=r"s3_prefix must be s3://bucket/prefix.*e\.g\."):
        collect_artifacts(tmp_path, ["ok"], tmp_path / "out", s3_prefix="bucket/prefix")


def test_artifacts_are_uploaded_and_read_back_identical(aws: S3Server, tmp_path: Path) -> None:
    client = aws.client()
    client.create_bucket(Bucket="artifacts")
    work, dest = tmp_path / "work", tmp_path / "out"
    write(work, JOB_OUTPUT | {"big.bin": os.urandom(9 * 1024 * 1024)})  # a multipart upload
    prefix = "s3://artifacts/vision/train-bert/attempt-2"
    patterns = ["model.pt", "logs", "big.bin"]
    manifest = collect_artifacts(
        work, patterns, dest, s3_prefix=prefix, s3_endpoint_url=aws.endpoint_url
    )

    listed = client.list_objects_v2(Bucket="artifacts", Prefix="vision/train-bert/attempt-2/")
    keys = sorted(o["Key"] for o in listed["Contents"])
    base = "vision/train-bert/attempt-2/"
    assert keys == sorted([base + f.path for f in manifest.files] + [base + "manifest.json"])
    for f in manifest.files:
        assert f.s3_uri == f"s3://artifacts/{base}{f.path}"
        obj = client.get_object(Bucket="artifacts", Key=base + f.path)
        assert sha(obj["Body"].read()) == f.sha256 == obj["Metadata"]["sha256"]
    remote = client.get_object(Bucket="artifacts", Key=base + "manifest.json")["Body"].read()
    assert ArtifactManifest.model_validate_json(remote) == manifest == ArtifactManifest.read(dest)


def test_a_missing_bucket_raises_after_keeping_the_local_copy(aws, tmp_path: Path) -> None:
    work, dest = tmp_path / "work", tmp_path / "out"
    write(work, {"model.pt": b"m"})
    with pytest.raises(ArtifactError, match=r"cannot use bucket 'gone'.*kept in"):
        collect_artifacts(
            work, ["model.pt"], dest, s3_prefix="s3://gone/x", s3_endpoint_url=aws.endpoint_url
        )
    assert [f.path for f in ArtifactManifest.read(dest).files] == ["model.pt"]


# -- the platform's setting: BERTH_ARTIFACTS_S3_PREFIX ------------------------------------------


def platform_env(monkeypatch: pytest.MonkeyPatch, home: Path, prefix: str, endpoint: dict) -> None:
    monkeypatch.setenv("BERTH_HOME", str(home))
    monkeypatch.setenv("BERTH_ARTIFACTS_S3_PREFIX", prefix)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    for name, value in endpoint.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("endpoint_var", ["MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"])
def test_the_platform_copies_every_attempt_under_its_s3_prefix(
    aws: S3Server, tmp_path: Path, monkeypatch, caplog, endpoint_var: str
) -> None:
    bucket = f"berth-{endpoint_var.lower().replace('_', '-')}"
    client = aws.client()
    client.create_bucket(Bucket=bucket)
    endpoint = {endpoint_var: aws.endpoint_url}
    platform_env(monkeypatch, tmp_path / "home", f"s3://{bucket}/platform/", endpoint)
    s = berth_settings()
    outputs = {  # attempt 1 failed half way: a checkpoint and its log, no model
        1: {"ckpt/step-100.pt": os.urandom(3000), "logs/stderr.txt": b"CUDA error: out of memory"},
        2: {"ckpt/step-200.pt": os.urandom(5000), "model.pt": b"weights" * 500},
    }
    got = {}
    for attempt, files in outputs.items():
        write(s.workdir("job-7", attempt), files)
        with caplog.at_level(logging.INFO):
            got[attempt] = collect_attempt(
                ["model.pt", "ckpt", "logs"],
                s.workdir("job-7", attempt),
                s.artifacts_dir / "job-7" / str(attempt),
                logging.getLogger("task"),
            )
        assert got[attempt].s3_prefix == f"s3://{bucket}/platform/job-7/{attempt}"

    for attempt, files in outputs.items():
        base = f"platform/job-7/{attempt}/"
        listed = client.list_objects_v2(Bucket=bucket, Prefix=base)["Contents"]
        sizes = {o["Key"].removeprefix(base): o["Size"] for o in listed}
        assert sizes.pop("manifest.json") > 0
        assert sizes == {rel: len(data) for rel, data in files.items()}
        for f in got[attempt].files:
            body = client.get_object(Bucket=bucket, Key=base + f.path)["Body"].read()
            assert f.size == len(files[f.path]) and f.sha256 == sha(files[f.path]) == sha(body)
            assert f.s3_uri == f"s3://{bucket}/{base}{f.path}"
        remote = client.get_object(Bucket=bucket, Key=base + "manifest.json")["Body"].read()
        assert ArtifactManifest.model_validate_json(remote) == got[attempt]
    assert got[1].missing == ("model.pt",)
    assert f"-> s3://{bucket}/platform/job-7/1/" in caplog.text
    # The collect step after the run task collects the attempt again: nothing is sent twice.
    collect_attempt(["model.pt", "ckpt"], s.workdir("job-7", 2), s.artifacts_dir / "job-7" / "2")
    assert aws.count("PUT", f"/{bucket}/platform/job-7/2/model.pt") == 1
    assert aws.count("PUT", f"/{bucket}/platform/job-7/2/manifest.json") == 2


def test_a_failed_upload_is_a_warning_and_the_local_copy_stays(
    aws: S3Server, tmp_path: Path, monkeypatch, caplog
) -> None:
    endpoint = {"MLFLOW_S3_ENDPOINT_URL": aws.endpoint_url}
    platform_env(monkeypatch, tmp_path / "home", "s3://no-such-bucket/x", endpoint)
    s = berth_settings()
    write(s.workdir("job-8", 1), {"model.pt": b"m"})
    dest = s.artifacts_dir / "job-8" / "1"
    with caplog.at_level(logging.WARNING):
        got = collect_attempt(["model.pt"], s.workdir("job-8", 1), dest, logging.getLogger("t"))
    assert "not copied to S3 (the job is not failed for it)" in caplog.text
    assert "cannot use bucket 'no-such-bucket'" in caplog.text
    assert [(f.path, f.s3_uri) for f in got.files] == [("model.pt", None)]
    assert got.s3_prefix is None and ArtifactManifest.read(dest) == got
    assert (dest / "model.pt").read_bytes() == b"m"


PREFIX = "BERTH_ARTIFACTS_S3_PREFIX"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {PREFIX: "ml-artifacts/x"},
            rf"{PREFIX} must be s3://bucket/prefix, got '.*'; e\.g\. 's3:",
        ),
        ({PREFIX: "s3://ML_Artifacts/x"}, rf"{PREFIX}: 'ML_Artifacts' is not a valid S3 bucket"),
        (
            {PREFIX: "s3://ml-artifacts", "MLFLOW_S3_ENDPOINT_URL": "minio:9000"},
            r"MLFLOW_S3_ENDPOINT_URL: must be an http\(s\) URL .*'minio:9000'; e\.g\. 'http://",
        ),
    ],
)
def test_a_bad_s3_setting_names_the_variable_and_the_fix(env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BerthSettings.from_env(env)


def test_without_the_setting_artifacts_stay_local() -> None:
    s = BerthSettings.from_env({"MLFLOW_S3_ENDPOINT_URL": "minio:9000"})  # only checked with it
    assert s.artifacts_s3_prefix is None


_name = st.text(alphabet="abcxyz019_-", min_size=1, max_size=6)
_tree = st.dictionaries(
    st.lists(_name, min_size=1, max_size=3).map("/".join), st.binary(max_size=64), max_size=8
)


@settings(max_examples=30, deadline=None)
@given(_tree)
def test_collecting_a_folder_copies_exactly_its_files(files: dict[str, bytes]) -> None:
    # a path that is also a folder of another (a, a/b) cannot exist on disk: keep the first
    kept: dict[str, bytes] = {}
    for rel, data in sorted(files.items()):
        if not any(rel.startswith(k + "/") or k.startswith(rel + "/") for k in kept):
            kept[rel] = data
    with tempfile.TemporaryDirectory() as tmp:
        work, dest = Path(tmp) / "work", Path(tmp) / "out"
        (work / "run").mkdir(parents=True)
        write(work / "run", kept)
        manifest = collect_artifacts(work, ["run"], dest)
        assert {f.path: f.sha256 for f in manifest.files} == {
            f"run/{rel}": sha(data) for rel, data in kept.items()
        }
        assert manifest.missing == ()
        for rel, data in kept.items():
            assert (dest / "run" / rel).read_bytes() == data
