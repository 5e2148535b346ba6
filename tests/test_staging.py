"""Data staging against real sources: local files, a local HTTPS server (tests/https_site.py:
http.server with TLS and a generated certificate), and moto's S3 server over HTTP; real
processes for concurrency.

Nothing is mocked: requests are counted on the server side to prove reuse.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from filelock import FileLock
from https_site import https_fixture, trust_fixture  # noqa: F401 (fixtures)
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from s3server import S3Server

from berth.staging import StagedInput, StagedInputs, StagingError, prune, rich_progress, stage
from berth.staging.sources import Throttle, s3_endpoint_url

ROOT = Path(__file__).resolve().parents[1]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entries(cache: Path) -> list[str]:
    """Keys of the complete entries in a cache."""
    folder = cache / "entries"
    return sorted(p.name[: -len(".meta.json")] for p in folder.glob("*.meta.json"))


# ---------------------------------------------------------------- file://


def test_file_is_staged_verified_and_reused(tmp_path: Path) -> None:
    src = tmp_path / "data" / "train.csv"
    src.parent.mkdir()
    src.write_bytes(b"a,b\n1,2\n" * 1000)
    cache = tmp_path / "cache"

    first = stage([src.as_uri()], cache)
    (item,) = first.inputs
    assert item.fetched and item.path.name == "train.csv"
    assert item.path.read_bytes() == src.read_bytes()
    assert (item.size, item.sha256) == (8000, sha(src.read_bytes()))
    meta = json.loads((cache / "entries" / f"{item.key}.meta.json").read_text())
    assert meta["uri"] == src.as_uri() and meta["sha256"] == item.sha256 and meta["size"] == 8000
    assert meta["key"] == item.key and dt.datetime.fromisoformat(meta["fetched_at"])

    again = stage([src.as_uri()], cache).inputs[0]
    assert not again.fetched and again.path == item.path and again.key == item.key

    src.write_bytes(b"new content")  # content-addressed: new content, new entry
    changed = stage([src.as_uri()], cache).inputs[0]
    assert changed.fetched and changed.key != item.key
    assert changed.path.read_bytes() == b"new content" and item.path.read_bytes() != b"new"
    assert len(entries(cache)) == 2


def test_directory_is_copied_as_a_snapshot(tmp_path: Path) -> None:
    src = tmp_path / "imagenet"
    (src / "train").mkdir(parents=True)
    (src / "train" / "a.bin").write_bytes(b"a" * 100)
    (src / "labels.txt").write_text("cat\ndog\n")
    (item,) = stage([src.as_uri()], tmp_path / "cache").inputs
    assert item.kind == "tree" and item.fetched and item.size == 108
    assert (item.path / "train" / "a.bin").read_bytes() == b"a" * 100
    assert (item.path / "labels.txt").read_text() == "cat\ndog\n"

    (src / "labels.txt").write_text("cat\ndog\nbird\n")  # the staged copy does not change
    assert (item.path / "labels.txt").read_text() == "cat\ndog\n"
    moved = stage([src.as_uri()], tmp_path / "cache").inputs[0]
    assert moved.fetched and moved.key != item.key


def test_every_bad_input_is_reported_before_anything_is_copied(tmp_path: Path) -> None:
    good = tmp_path / "good.bin"
    good.write_bytes(b"x" * 10)
    locked = tmp_path / "locked.bin"
    locked.write_bytes(b"secret")
    locked.chmod(0)
    uris = [good.as_uri(), (tmp_path / "nope.bin").as_uri(), locked.as_uri()]
    cache = tmp_path / "cache"
    with pytest.raises(StagingError) as caught:
        stage(uris, cache)
    text = str(caught.value)
    assert f"inputs[1] {uris[1]}: no such file or directory" in text
    if os.geteuid() != 0:  # root reads anything
        assert f"inputs[2] {uris[2]}: file {locked} is not readable" in text
    assert [p.index for p in caught.value.problems] == ([1, 2] if os.geteuid() else [1])
    assert entries(cache) == []  # the good input was not staged either


# ---------------------------------------------------------------- https://


def test_https_is_reused_without_a_second_download(trust, tmp_path: Path) -> None:
    site, base = trust
    body = os.urandom(300_000)
    site.files["/data/shard-0.tar"] = (body, {"ETag": '"v1"'})
    uri = f"{base}/data/shard-0.tar"
    cache = tmp_path / "cache"

    first = stage([uri], cache).inputs[0]
    assert first.fetched and first.path.read_bytes() == body and first.sha256 == sha(body)
    assert site.count("GET", "/data/shard-0.tar") == 1
    again = stage([uri], cache).inputs[0]
    assert not again.fetched and again.path == first.path
    assert site.count("GET", "/data/shard-0.tar") == 1  # HEAD only
    assert site.count("HEAD", "/data/shard-0.tar") == 2

    site.files["/data/shard-0.tar"] = (body[:1000], {"ETag": '"v2"'})  # a new version
    newer = stage([uri], cache).inputs[0]
    assert newer.fetched and newer.path.read_bytes() == body[:1000]


def test_https_without_validators_is_keyed_by_its_sha256(trust, tmp_path: Path) -> None:
    site, base = trust
    site.files["/plain.txt"] = (b"no etag here", {})
    cache = tmp_path / "cache"
    first = stage([f"{base}/plain.txt"], cache).inputs[0]
    again = stage([f"{base}/plain.txt"], cache).inputs[0]
    assert first.fetched and not again.fetched and again.path == first.path
    assert site.count("GET", "/plain.txt") == 2  # only the content can tell it is the same
    assert entries(cache) == [first.key] and not any((cache / "tmp").iterdir())


def test_https_without_head_is_probed_with_a_get(trust, tmp_path: Path) -> None:
    site, base = trust
    site.files["/signed.bin"] = (b"signed content", {"ETag": '"s1"'})
    site.no_head.add("/signed.bin")
    first = stage([f"{base}/signed.bin"], tmp_path).inputs[0]
    assert first.path.read_bytes() == b"signed content"
    again = stage([f"{base}/signed.bin"], tmp_path).inputs[0]
    assert first.fetched and not again.fetched
    assert site.count("HEAD", "/signed.bin") == 2 and site.count("GET", "/signed.bin") == 3


def test_https_not_found_names_the_input(trust, tmp_path: Path) -> None:
    site, base = trust
    site.files["/ok.bin"] = (b"ok", {"ETag": '"1"'})
    uris = [f"{base}/ok.bin", f"{base}/missing.bin"]
    with pytest.raises(StagingError) as caught:
        stage(uris, tmp_path / "cache")
    assert str(caught.value) == f"inputs[1] {uris[1]}: not found (HTTP 404); check the URL"
    assert site.count("GET", "/ok.bin") == 0


def test_a_server_error_may_pass_on_a_retry_and_a_missing_file_never(trust, tmp_path) -> None:
    site, base = trust
    site.errors |= {"/busy.bin": 503, "/slow.bin": 429}
    busy = [f"{base}/busy.bin", f"{base}/slow.bin"]
    with pytest.raises(StagingError) as caught:
        stage(busy, tmp_path / "cache")
    assert caught.value.transient  # every problem may pass: Airflow's retries may stage them
    assert "HTTP 503" in str(caught.value) and "retry later" in str(caught.value)
    with pytest.raises(StagingError) as caught:
        stage([*busy, f"{base}/missing.bin"], tmp_path / "cache")
    assert [p.transient for p in caught.value.problems] == [True, True, False]
    assert not caught.value.transient  # a missing file needs a fix: fail now


def test_https_untrusted_certificate_says_how_to_trust_it(https, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    site, base, _ = https
    site.files["/x"] = (b"x", {})
    with pytest.raises(StagingError, match=r"inputs\[0\] .*/x: TLS certificate not trusted.*"):
        stage([f"{base}/x"], tmp_path / "cache")


# ---------------------------------------------------------------- s3://


def test_s3_is_staged_and_reused_without_a_second_get(aws: S3Server, tmp_path: Path) -> None:
    client = aws.client()
    client.create_bucket(Bucket="reuse")
    body = os.urandom(1_000_000)
    client.put_object(Bucket="reuse", Key="sets/train.bin", Body=body)
    cache = tmp_path / "cache"

    first = stage(["s3://reuse/sets/train.bin"], cache, s3_endpoint_url=aws.endpoint_url)
    item = first.inputs[0]
    assert item.fetched and item.path.read_bytes() == body and item.path.name == "train.bin"
    gets = aws.count("GET", "/reuse/sets/train.bin")
    assert gets >= 1
    meta = json.loads((cache / "entries" / f"{item.key}.meta.json").read_text())
    assert meta["etag"] == client.head_object(Bucket="reuse", Key="sets/train.bin")["ETag"]

    again = stage(["s3://reuse/sets/train.bin"], cache, s3_endpoint_url=aws.endpoint_url)
    assert not again.inputs[0].fetched and again.inputs[0].path == item.path
    assert aws.count("GET", "/reuse/sets/train.bin") == gets


def test_s3_problems_are_all_reported_at_once(aws: S3Server, tmp_path: Path) -> None:
    client = aws.client()
    client.create_bucket(Bucket="present")
    client.put_object(Bucket="present", Key="ok.bin", Body=b"ok")
    client.put_object(Bucket="present", Key="folder/a.bin", Body=b"a")
    uris = [
        "s3://present/ok.bin",
        "s3://present/no-such-key.bin",
        "s3://no-such-bucket/key.bin",
        "s3://present/folder",
    ]
    with pytest.raises(StagingError) as caught:
        stage(uris, tmp_path / "cache", s3_endpoint_url=aws.endpoint_url)
    lines = str(caught.value).splitlines()
    assert lines == [
        "inputs[1] s3://present/no-such-key.bin: no such object (404); check the bucket and "
        "key, or the credentials in AWS_* / the endpoint in MLFLOW_S3_ENDPOINT_URL or "
        "BERTH_S3_ENDPOINT_URL",
        "inputs[2] s3://no-such-bucket/key.bin: no such bucket 'no-such-bucket' (404); check "
        "the bucket and key, or the credentials in AWS_* / the endpoint in "
        "MLFLOW_S3_ENDPOINT_URL or BERTH_S3_ENDPOINT_URL",
        "inputs[3] s3://present/folder: no such object, but a folder of that name; write "
        "s3://present/folder/",
    ]
    assert aws.count("GET", "/present/ok.bin") == 0  # checked, not downloaded


def test_s3_prefix_is_staged_as_a_folder(aws: S3Server, tmp_path: Path) -> None:
    client = aws.client()
    client.create_bucket(Bucket="folders")
    files = {"shards/0.bin": b"zero", "shards/1.bin": b"one", "index.json": b"{}"}
    for rel, data in files.items():
        client.put_object(Bucket="folders", Key=f"ds/v1/{rel}", Body=data)
    client.put_object(Bucket="folders", Key="ds/v10/other.bin", Body=b"not this one")
    (item,) = stage(["s3://folders/ds/v1/"], tmp_path, s3_endpoint_url=aws.endpoint_url).inputs
    assert item.kind == "tree" and item.path.name == "v1" and item.size == 9
    got = {p.relative_to(item.path).as_posix(): p.read_bytes() for p in item.path.rglob("*.*")}
    assert got == files


def test_corrupt_entry_is_detected_and_refetched(aws: S3Server, tmp_path: Path) -> None:
    client = aws.client()
    client.create_bucket(Bucket="corrupt")
    body = os.urandom(200_000)
    client.put_object(Bucket="corrupt", Key="model.bin", Body=body)
    args = (["s3://corrupt/model.bin"], tmp_path)
    item = stage(*args, s3_endpoint_url=aws.endpoint_url).inputs[0]
    gets = aws.count("GET", "/corrupt/model.bin")

    item.path.write_bytes(bytes(200_000))  # same size, other bytes: only sha256 can tell
    fixed = stage(*args, s3_endpoint_url=aws.endpoint_url).inputs[0]
    assert fixed.fetched and fixed.path.read_bytes() == body
    assert aws.count("GET", "/corrupt/model.bin") == 2 * gets

    item.path.write_bytes(body[:10])  # truncated: even the size-only check finds it
    fixed = stage(*args, s3_endpoint_url=aws.endpoint_url, verify_cached=False).inputs[0]
    assert fixed.fetched and fixed.path.read_bytes() == body


def test_progress_reports_increasing_bytes_up_to_the_total(aws: S3Server, tmp_path: Path) -> None:
    client = aws.client()
    client.create_bucket(Bucket="progress")
    body = os.urandom(3_000_000)
    client.put_object(Bucket="progress", Key="big.bin", Body=body)
    calls: list[tuple[str, int, int | None]] = []
    stage(
        ["s3://progress/big.bin"],
        tmp_path,
        progress=lambda *call: calls.append(call),
        s3_endpoint_url=aws.endpoint_url,
    )
    assert {uri for uri, _, _ in calls} == {"s3://progress/big.bin"}
    assert {total for _, _, total in calls} == {len(body)}
    done = [d for _, d, _ in calls]
    assert done[0] == 0 and done[-1] == len(body)
    assert all(a < b for a, b in itertools.pairwise(done))


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=50))
def test_throttle_sends_strictly_increasing_counts_ending_at_the_sum(adds: list[int]) -> None:
    sent: list[int] = []
    throttle = Throttle(lambda _u, done, _t: sent.append(done), "s3://b/k", sum(adds), every_s=0)
    throttle.restart()
    for n in adds:
        throttle.add(n)
    throttle.finish()
    assert sent[0] == 0 and sent[-1] == sum(adds)
    assert all(a < b for a, b in itertools.pairwise(sent))


def test_rich_progress_draws_a_bar_per_input(tmp_path: Path) -> None:
    src = tmp_path / "weights.bin"
    src.write_bytes(b"w" * 50_000)
    out = io.StringIO()
    with rich_progress(Console(file=out, width=150)) as progress:
        stage([src.as_uri()], tmp_path / "cache", progress=progress)
    assert src.as_uri() in out.getvalue() and "50.0 kB" in out.getvalue()


CHILD = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from berth.staging import stage
    go = Path(sys.argv[3])
    deadline = time.monotonic() + 30
    while not go.exists():  # start together, so that both reach the lock at once
        assert time.monotonic() < deadline, "never told to go"
        time.sleep(0.01)
    staged = stage([sys.argv[1]], Path(sys.argv[2]), s3_endpoint_url=sys.argv[4])
    print(staged.model_dump_json())
    """
)


def test_two_processes_download_a_dataset_once(aws: S3Server, tmp_path: Path) -> None:
    client = aws.client()
    client.create_bucket(Bucket="shared")
    body = os.urandom(20 * 1024 * 1024)
    client.put_object(Bucket="shared", Key="big.bin", Body=body)
    uri, path = "s3://shared/big.bin", "/shared/big.bin"
    # What one download costs in GETs (boto3 splits big objects into ranged parts).
    stage([uri], tmp_path / "reference", s3_endpoint_url=aws.endpoint_url)
    one_download = aws.count("GET", path)

    go, cache = tmp_path / "go", tmp_path / "cache"
    argv = [sys.executable, "-c", CHILD, uri, str(cache), str(go), aws.endpoint_url]
    children = [
        subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    go.touch()
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err.decode()
        results.append(StagedInputs.model_validate_json(out).inputs[0])
    assert aws.count("GET", path) == 2 * one_download  # the reference's and one more
    assert results[0].path == results[1].path
    assert sorted(r.fetched for r in results) == [False, True]
    assert results[0].path.read_bytes() == body and results[0].sha256 == sha(body)


# ---------------------------------------------------------------- the cache and the result


def test_prune_removes_least_recently_used_entries_but_not_locked_ones(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    staged = {}
    for i, name in enumerate(["old", "middle", "new"]):
        src = tmp_path / name
        src.write_bytes(bytes([i]) * 1000)
        staged[name] = stage([src.as_uri()], cache).inputs[0]
        meta = cache / "entries" / f"{staged[name].key}.meta.json"
        os.utime(meta, (time.time() - 100 + i, time.time() - 100 + i))  # distinct last uses

    with FileLock(cache / "locks" / f"{staged['old'].key}.lock"):  # "old" is being staged
        result = prune(cache, max_bytes=2000)
    assert result.busy == (staged["old"].key,)  # the oldest, but in use: the next one goes
    assert result.removed == (staged["middle"].key,) and result.freed_bytes == 1000
    assert result.kept_bytes == 2000
    assert entries(cache) == sorted([staged["old"].key, staged["new"].key])

    assert prune(cache, max_bytes=1000).removed == (staged["old"].key,)
    assert not staged["old"].path.exists() and staged["new"].path.exists()
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        prune(cache, -1)


def test_staged_inputs_describe_paths_for_replicas() -> None:
    def item(i: int, path: str) -> StagedInput:
        return StagedInput(
            index=i, uri="s3://b/k", path=Path(path), kind="file", key="k", size=1, sha256="s",
            fetched=True,
        )  # fmt: skip

    staged = StagedInputs(
        inputs=(item(0, "/c/1/train.csv"), item(1, "/c/2/a.bin"), item(2, "/c/3/a.bin"))
    )
    assert staged.env() == {
        "BERTH_INPUT_0": "/c/1/train.csv",
        "BERTH_INPUT_1": "/c/2/a.bin",
        "BERTH_INPUT_2": "/c/3/a.bin",
        "BERTH_INPUT_COUNT": "3",
        "BERTH_INPUT_TRAIN_CSV": "/c/1/train.csv",
    }
    assert staged.by_name() == {"train.csv": Path("/c/1/train.csv")}  # a.bin is ambiguous
    assert StagedInputs.model_validate_json(staged.model_dump_json()) == staged


@pytest.mark.parametrize(
    ("environ", "argument", "expected"),
    [
        ({}, None, None),
        ({}, "http://arg", "http://arg"),
        ({"MLFLOW_S3_ENDPOINT_URL": "http://mlflow"}, "http://arg", "http://arg"),
        ({"MLFLOW_S3_ENDPOINT_URL": "http://mlflow"}, None, "http://mlflow"),
        (
            {"BERTH_S3_ENDPOINT_URL": "http://berth", "MLFLOW_S3_ENDPOINT_URL": "http://mlflow"},
            None,
            "http://berth",
        ),
        ({"BERTH_S3_ENDPOINT_URL": ""}, "http://arg", "http://arg"),
    ],
)
def test_s3_endpoint_precedence(environ, argument, expected) -> None:
    assert s3_endpoint_url(argument, environ) == expected
