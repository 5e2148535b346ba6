"""One fetcher per input scheme (file://, https://, s3://): check an input, then fetch it.

Each source does two things, in two phases, so that `stage` can check every input before it
downloads any:

- `probe(uri)`: is the input there and readable, and what is its identity (S3 ETag + size +
  version; HTTP strong ETag or Last-Modified + Content-Length)? Raises `SourceProblem` with
  what is wrong and the fix.
- `plan(probe, scratch, progress)`: the cache key and a `fill(path)` that writes the content.
  Where the identity is only the content itself (file://, an HTTP server without validators),
  `plan` reads the content first to hash it.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import boto3
import httpx
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from berth.staging.cache import CHUNK, Kind, digest, identity_key, tree_files

# Called as (uri, bytes_done, bytes_total); bytes_total is None when the server does not say.
ProgressCallback = Callable[[str, int, int | None], None]

ENDPOINT_VARS = ("BERTH_S3_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL")
S3_FIX = (
    "check the bucket and key, or the credentials in AWS_* / the endpoint in "
    "MLFLOW_S3_ENDPOINT_URL or BERTH_S3_ENDPOINT_URL"
)


class SourceProblem(Exception):
    """What is wrong with one input and how to fix it; `stage` adds the input's index and URI.
    `transient`: the source may answer next time (a broken connection, a server error, a
    throttle, an object that changed under the copy), so a retry can help."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True, slots=True)
class Probe:
    """What a check found: the payload's name and kind, its size, and its identity if known."""

    uri: str
    name: str
    kind: Kind
    size: int | None
    identity: tuple[object, ...] | None  # None: the identity is the content's sha256
    details: Mapping[str, Any] = field(default_factory=dict)  # recorded in the meta file


@dataclass(frozen=True, slots=True)
class Plan:
    """How to get one input into the cache: under which key, and what to check it against."""

    key: str
    fill: Callable[[Path], None]
    expected_size: int | None = None
    expected_sha256: str | None = None


class Source(Protocol):
    def probe(self, uri: str) -> Probe: ...

    def plan(self, probe: Probe, scratch: Path, progress: Throttle) -> Plan: ...


class Throttle:
    """Calls a progress callback with strictly increasing byte counts, at most every `every_s`.

    Thread-safe: boto3 reports progress from its transfer threads.
    """

    def __init__(
        self, callback: ProgressCallback | None, uri: str, total: int | None, every_s: float = 0.2
    ) -> None:
        self.callback, self.uri, self.total, self.every_s = callback, uri, total, every_s
        self.done = 0
        self._sent = -1
        self._at = 0.0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            if time.monotonic() - self._at >= self.every_s:
                self._send()

    def restart(self) -> None:
        """A fill starts (again): report from zero."""
        with self._lock:
            self.done, self._sent = 0, -1
            self._send()

    def finish(self) -> None:
        with self._lock:
            self._send()

    def _send(self) -> None:
        if self.callback is not None and self.done > self._sent:
            self.callback(self.uri, self.done, self.total)
            self._sent, self._at = self.done, time.monotonic()


def source_for(uri: str, s3: S3Source) -> Source:
    """The source for an input's scheme (already validated by the job spec)."""
    scheme = urlsplit(uri).scheme
    if scheme == "s3":
        return s3
    if scheme == "https":
        return HttpsSource()
    if scheme == "file":
        return FileSource()
    raise SourceProblem(
        f"scheme {scheme!r} is not supported; use s3://bucket/key, file:///absolute/path or "
        "https://host/path"
    )


def copy_file(src: Path, dst: Path, progress: Throttle) -> None:
    """Copy in chunks, reporting progress (shutil.copyfile cannot report)."""
    with src.open("rb") as r, dst.open("wb") as w:
        while chunk := r.read(CHUNK):
            w.write(chunk)
            progress.add(len(chunk))


class FileSource:
    """file:///absolute/path: a file, or a directory copied whole.

    A directory is copied (not symlinked) and keyed by a hash over relative paths and contents:
    a replica then reads a snapshot that later edits of the source cannot change under it
    (retries see the same data), and the cache can be mounted where the source is not.
    """

    def probe(self, uri: str) -> Probe:
        path = Path(unquote(urlsplit(uri).path))
        where = "on the machine that stages the data (the Airflow worker)"
        try:
            st = path.stat()
        except FileNotFoundError:
            raise SourceProblem(
                f"no such file or directory; check the path, and that it exists {where}"
            ) from None
        except PermissionError:
            raise SourceProblem(
                f"permission denied on a parent directory of {path}; make it readable {where}"
            ) from None
        if path.is_dir():
            if not os.access(path, os.R_OK | os.X_OK):
                raise SourceProblem(f"directory {path} is not readable; chmod it or stage a copy")
            total = 0
            for rel, p in tree_files(path):
                if not os.access(p, os.R_OK):
                    raise SourceProblem(f"{rel} in the directory is not readable; chmod it")
                total += p.stat().st_size
            return Probe(uri, path.name or "input", "tree", total, None)
        if not path.is_file():
            raise SourceProblem("is neither a regular file nor a directory; give a file or folder")
        if not os.access(path, os.R_OK):
            raise SourceProblem(f"file {path} is not readable; chmod it or stage a copy")
        return Probe(uri, path.name, "file", st.st_size, None)

    def plan(self, probe: Probe, scratch: Path, progress: Throttle) -> Plan:
        src = Path(unquote(urlsplit(probe.uri).path))
        size, sha = digest(src)
        progress.total = size

        def fill(dst: Path) -> None:
            progress.restart()
            if probe.kind == "file":
                copy_file(src, dst, progress)
            else:
                for rel, p in tree_files(src):
                    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                    copy_file(p, dst / rel, progress)
                dst.mkdir(exist_ok=True)  # an empty directory is still an input
            progress.finish()

        key = identity_key("sha256", probe.kind, sha, probe.name)
        return Plan(key, fill, size, sha)


class HttpsSource:
    """https:// URLs, streamed in chunks; keyed by a strong ETag or Last-Modified when given."""

    def __init__(self) -> None:
        # identity: the bytes as stored, so that Content-Length and the ETag describe them
        self.headers = {"Accept-Encoding": "identity"}

    def _client(self) -> httpx.Client:
        timeout = httpx.Timeout(30.0, read=300.0)
        return httpx.Client(follow_redirects=True, timeout=timeout, headers=self.headers)

    def probe(self, uri: str) -> Probe:
        try:
            with self._client() as client:
                r = client.head(uri)
                if r.status_code in (403, 405, 501):  # presigned URLs sign GET only
                    with client.stream("GET", uri, headers={"Range": "bytes=0-0"}) as r:
                        pass
        except httpx.HTTPError as e:
            raise SourceProblem(_http_failure(e), transient=True) from None
        if r.status_code >= 400:
            raise _http_problem(r.status_code, r.reason_phrase)
        size = _http_size(r)
        etag = r.headers.get("ETag", "")
        validator = etag if etag and not etag.startswith("W/") else r.headers.get("Last-Modified")
        name = unquote(PurePosixPath(urlsplit(uri).path).name) or "download"
        identity = ("https", uri, validator, size) if validator else None
        return Probe(uri, name, "file", size, identity, {"etag": etag or None})

    def plan(self, probe: Probe, scratch: Path, progress: Throttle) -> Plan:
        if probe.identity is not None:
            return Plan(identity_key(*probe.identity), self._fill(probe, progress), probe.size)
        # No validator: the content is the only identity, so download first and hash it.
        fd, name = tempfile.mkstemp(prefix="https-", dir=scratch)
        os.close(fd)
        first = Path(name)
        self._fill(probe, progress)(first)
        size, sha = digest(first)

        def fill(dst: Path) -> None:
            if first.exists():
                os.replace(first, dst)
            else:  # the first download was rejected by the cache; fetch once more
                self._fill(probe, progress)(dst)

        return Plan(identity_key("sha256", "file", sha, probe.name), fill, size, sha)

    def _fill(self, probe: Probe, progress: Throttle) -> Callable[[Path], None]:
        def fill(dst: Path) -> None:
            progress.restart()
            try:
                with self._client() as client, client.stream("GET", probe.uri) as r:
                    if r.status_code >= 400:
                        raise _http_problem(r.status_code, r.reason_phrase)
                    etag = probe.details.get("etag")
                    if etag and r.headers.get("ETag") not in (None, etag):
                        raise SourceProblem(
                            "changed while it was being staged; run again", transient=True
                        )
                    with dst.open("wb") as f:
                        for chunk in r.iter_raw(CHUNK):
                            f.write(chunk)
                            progress.add(len(chunk))
            except httpx.HTTPError as e:
                raise SourceProblem(_http_failure(e), transient=True) from None
            progress.finish()

        return fill


def _http_size(r: httpx.Response) -> int | None:
    total = r.headers.get("Content-Range", "").rpartition("/")[2]
    length = total if r.status_code == 206 else r.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def _http_problem(status: int, reason: str) -> SourceProblem:
    """An HTTP error answer; a server error or a throttle (429) may pass on a retry."""
    return SourceProblem(_http_status(status, reason), transient=status >= 500 or status == 429)


# S3 error codes that say "not now" rather than "not so" (besides any 5xx status).
_S3_BUSY = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout"})


def _s3_busy(e: ClientError) -> bool:
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return status >= 500 or e.response.get("Error", {}).get("Code") in _S3_BUSY


def _http_status(status: int, reason: str) -> str:
    if status in (404, 410):
        return f"not found (HTTP {status}); check the URL"
    if status in (401, 403):
        return (
            f"access denied (HTTP {status}); check the URL's credentials or signature "
            "(a presigned URL may have expired)"
        )
    return f"the server answered HTTP {status} {reason}; check the URL, or retry later"


def _http_failure(e: httpx.HTTPError) -> str:
    text = str(e) or type(e).__name__
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            f"TLS certificate not trusted ({text}); if the server uses a private CA, set "
            "SSL_CERT_FILE to its bundle"
        )
    return f"cannot fetch ({text}); check the host name and the network"


def s3_endpoint_url(argument: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The S3 endpoint: `argument` when given, else BERTH_S3_ENDPOINT_URL, else
    MLFLOW_S3_ENDPOINT_URL (MLflow's convention, so one setting on a worker serves both).

    None means AWS itself (boto3's default chain picks region and credentials either way).
    An explicit argument wins, as anywhere else: the caller asked for that endpoint.
    """
    if argument:
        return argument
    for var in ENDPOINT_VARS:
        if environ.get(var):
            return environ[var]
    return None


def s3_client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client on `s3_endpoint_url(endpoint_url)`, with bounded waits and retries."""
    config = Config(connect_timeout=10, read_timeout=120, retries={"mode": "standard"})
    return boto3.client("s3", endpoint_url=s3_endpoint_url(endpoint_url), config=config)


def split_s3(uri: str) -> tuple[str, str]:
    """s3://bucket/some%20key -> ('bucket', 'some key')."""
    parts = urlsplit(uri)
    return parts.netloc, unquote(parts.path.lstrip("/"))


class S3Source:
    """s3://bucket/key (one object) or s3://bucket/prefix/ (every object under it)."""

    def __init__(self, endpoint_url: str | None = None) -> None:
        self.endpoint_url = endpoint_url
        self._client: Any = None
        self.transfer = TransferConfig(max_concurrency=4)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.endpoint_url)
        return self._client

    def probe(self, uri: str) -> Probe:
        bucket, key = split_s3(uri)
        try:
            return self._prefix(uri, bucket, key) if key.endswith("/") else self._object(uri)
        except ClientError as e:
            raise SourceProblem(self._explain(e, bucket, key), transient=_s3_busy(e)) from None
        except NoCredentialsError:
            raise SourceProblem(
                "no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE, or run with an instance role"
            ) from None
        except BotoCoreError as e:
            raise SourceProblem(f"cannot reach S3 ({e}); {S3_FIX}", transient=True) from None

    def _object(self, uri: str) -> Probe:
        bucket, key = split_s3(uri)
        head = self.client.head_object(Bucket=bucket, Key=key)
        etag, size, version = head["ETag"], head["ContentLength"], head.get("VersionId")
        name = PurePosixPath(key).name
        identity = ("s3", bucket, key, etag, size, version)
        return Probe(uri, name, "file", size, identity, {"etag": etag, "version_id": version})

    def _prefix(self, uri: str, bucket: str, prefix: str) -> Probe:
        objects = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix
        ):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if rel.endswith("/"):  # a "folder" marker object, no content
                    continue
                if ".." in rel.split("/") or rel.startswith("/"):
                    raise SourceProblem(f"object key {obj['Key']!r} would leave the folder")
                objects.append((rel, obj["ETag"], obj["Size"]))
        if not objects:
            self.client.head_bucket(Bucket=bucket)  # a missing bucket says so, not "empty"
            raise SourceProblem(f"no objects under the prefix; {S3_FIX}")
        objects.sort()
        size = sum(s for _, _, s in objects)
        name = PurePosixPath(prefix).name
        details = {"objects": len(objects), "listing": objects}
        identity = ("s3-prefix", bucket, prefix, *(x for o in objects for x in o))
        return Probe(uri, name, "tree", size, identity, details)

    def _explain(self, e: ClientError, bucket: str, key: str) -> str:
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
            if code == "NoSuchBucket" or not self._bucket_exists(bucket):
                return f"no such bucket {bucket!r} (404); {S3_FIX}"
            if not key.endswith("/") and self._has_prefix(bucket, key + "/"):
                return f"no such object, but a folder of that name; write s3://{bucket}/{key}/"
            return f"no such object (404); {S3_FIX}"
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return (
                f"access denied ({code}); check the credentials in AWS_* (or the profile or "
                "role) and the bucket's policy, or the endpoint in MLFLOW_S3_ENDPOINT_URL or "
                "BERTH_S3_ENDPOINT_URL"
            )
        if code in ("301", "PermanentRedirect", "AuthorizationHeaderMalformed"):
            return f"the bucket is in another region ({code}); set AWS_DEFAULT_REGION to it"
        return f"S3 error {code} (HTTP {status}); {S3_FIX}"

    def _bucket_exists(self, bucket: str) -> bool:
        try:
            self.client.head_bucket(Bucket=bucket)
        except ClientError as e:
            return e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket")
        return True

    def _has_prefix(self, bucket: str, prefix: str) -> bool:
        try:
            listing = self.client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        except ClientError:
            return False
        return bool(listing.get("Contents"))

    def plan(self, probe: Probe, scratch: Path, progress: Throttle) -> Plan:
        bucket, key = split_s3(probe.uri)

        def fill(dst: Path) -> None:
            progress.restart()
            if probe.kind == "file":
                self._download(bucket, key, dst, probe.details, progress)
            else:
                dst.mkdir()
                for rel, etag, _ in probe.details["listing"]:
                    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                    self._download(bucket, key + rel, dst / rel, {"etag": etag}, progress)
            progress.finish()

        assert probe.identity is not None  # S3 always knows the identity from HEAD / LIST
        return Plan(identity_key(*probe.identity), fill, probe.size)

    def _download(
        self, bucket: str, key: str, dst: Path, details: Mapping[str, Any], progress: Throttle
    ) -> None:
        version = details.get("version_id")
        extra = {"VersionId": version} if version else None
        try:
            self.client.download_file(
                bucket, key, str(dst), ExtraArgs=extra, Callback=progress.add, Config=self.transfer
            )
            # boto3 pins the ETag of its own HEAD; ours must be the same object, or the cache
            # key would name content it does not hold.
            after = self.client.head_object(Bucket=bucket, Key=key, **(extra or {}))["ETag"]
        except (ClientError, BotoCoreError) as e:
            raise SourceProblem(
                f"download of s3://{bucket}/{key} failed ({e}); {S3_FIX}", transient=True
            ) from None
        if after != details["etag"]:
            raise SourceProblem(
                f"s3://{bucket}/{key} changed while it was being staged; run again", transient=True
            )
