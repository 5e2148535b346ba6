"""Collect what a job attempt wrote: copy it out of the working directory, optionally upload it
to S3, and record a manifest (relative path, size, sha256 of every file) for MLflow logging.

Collection runs after failed attempts too (partial checkpoints, logs), so nothing the job did or
did not write is an error: a pattern that matches nothing is listed as missing, and a file that
cannot be read, or a symlink that points outside the working directory (which would copy files
the job does not own), is listed as skipped with the reason. Only S3 upload failures raise
(ArtifactError), and only after the local copy and its manifest are written.

The S3 copy (`upload_artifacts`) puts every file under the prefix with its sha256 in the object's
metadata, skips a file already there with the same size and sha256 (an attempt collected twice,
by the run task and by the collect step, is uploaded once), and uploads the manifest last.

Patterns are the job spec's artifact paths: a relative file or directory, or a glob (`*`, `?`,
`[...]`, and `**` for any depth), e.g. `checkpoints/*.pt`, `logs/**/*.txt`.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from boto3.exceptions import Boto3Error
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, ConfigDict

from berth.spec_fields import artifact_path
from berth.staging.cache import CHUNK, write_meta
from berth.staging.sources import S3_FIX, s3_client

MANIFEST = "manifest.json"
# S3's bucket naming rules (which MinIO and other S3-compatible stores follow too).
BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# What boto3 raises for a request that failed: its own upload errors are not botocore's.
_S3_ERRORS = (ClientError, BotoCoreError, Boto3Error)


class ArtifactError(Exception):
    """Artifacts could not be uploaded (the local copy and manifest are already written)."""


class ArtifactFile(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str  # relative to the working directory (and to dest), with '/' separators
    size: int
    sha256: str
    s3_uri: str | None = None


class Skipped(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    reason: str


class ArtifactManifest(BaseModel):
    """What one collection copied, what was missing and what was skipped; `manifest.json`."""

    model_config = ConfigDict(frozen=True)

    workdir: str
    dest: str
    s3_prefix: str | None = None
    collected_at: datetime
    patterns: tuple[str, ...]
    files: tuple[ArtifactFile, ...] = ()
    missing: tuple[str, ...] = ()  # patterns that matched nothing
    skipped: tuple[Skipped, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def read(cls, path: Path) -> ArtifactManifest:
        """Load a manifest.json (or the manifest in a collection's dest directory)."""
        path = Path(path)
        return cls.model_validate_json((path / MANIFEST if path.is_dir() else path).read_text())


def collect_artifacts(
    workdir: Path,
    patterns: Sequence[str],
    dest: Path,
    *,
    s3_prefix: str | None = None,
    s3_endpoint_url: str | None = None,
) -> ArtifactManifest:
    """Copy the artifacts matching `patterns` from `workdir` to `dest` (keeping relative paths),
    write `dest/manifest.json`, and upload both under `s3_prefix` (s3://bucket/prefix) if given
    (see `upload_artifacts`; raises ArtifactError after the local copy is complete).
    """
    if isinstance(patterns, str):
        raise TypeError(f"patterns must be a list of paths, got the string {patterns!r}")
    if s3_prefix is not None:
        parse_s3_prefix(s3_prefix)  # a bad prefix is refused before anything is copied
    for i, pattern in enumerate(patterns):
        try:
            artifact_path(pattern)
        except ValueError as e:
            raise ValueError(f"patterns[{i}] {pattern!r} {e}") from None
    workdir, dest = Path(workdir).absolute(), Path(dest).absolute()
    dest.mkdir(parents=True, exist_ok=True)

    found, missing, skipped = _expand(workdir, patterns, dest)
    files = []
    for rel, src in found.items():
        if rel == MANIFEST:
            skipped.append(Skipped(path=rel, reason=f"collides with Berth's {MANIFEST}; rename it"))
            continue
        try:
            size, sha = _copy_hashing(src, dest / rel)
        except OSError as e:  # unreadable, or vanished since the listing
            skipped.append(Skipped(path=rel, reason=f"cannot be read ({e.strerror or e})"))
            continue
        files.append(ArtifactFile(path=rel, size=size, sha256=sha))

    manifest = ArtifactManifest(
        workdir=str(workdir),
        dest=str(dest),
        collected_at=datetime.now(UTC),
        patterns=tuple(patterns),
        files=tuple(files),
        missing=tuple(missing),
        skipped=tuple(skipped),
    )
    _write(manifest, dest)
    if s3_prefix is not None:
        manifest = upload_artifacts(manifest, s3_prefix, s3_endpoint_url=s3_endpoint_url)
    return manifest


def upload_artifacts(
    manifest: ArtifactManifest, s3_prefix: str, *, s3_endpoint_url: str | None = None
) -> ArtifactManifest:
    """Upload a collection (its files in `manifest.dest`) under `s3_prefix` (s3://bucket/prefix)
    and return its manifest with the S3 locations, also rewritten in `dest/manifest.json`.

    The endpoint is `s3_endpoint_url`, else BERTH_S3_ENDPOINT_URL or MLFLOW_S3_ENDPOINT_URL, else
    boto3's own (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the AWS config). A file already there
    with the same size and sha256 is not sent again. The manifest goes last, so that its
    presence in S3 means every file is there. Raises ArtifactError, naming the object and the
    fix; the local copy stays as it is.
    """
    bucket, prefix = parse_s3_prefix(s3_prefix)
    dest = Path(manifest.dest)
    try:
        client = s3_client(s3_endpoint_url)
    except ValueError as e:  # boto3 refuses a malformed endpoint URL
        raise ArtifactError(
            f"s3_prefix {s3_prefix}: no S3 client ({e}); {S3_FIX}; the artifacts are kept in {dest}"
        ) from None
    try:
        client.head_bucket(Bucket=bucket)
    except _S3_ERRORS as e:
        raise ArtifactError(
            f"s3_prefix {s3_prefix}: cannot use bucket {bucket!r} ({e}); create it or "
            f"{S3_FIX}; the artifacts are kept in {dest}"
        ) from None
    uploaded = []
    for f in manifest.files:
        if not _same_object(client, bucket, prefix + f.path, f):
            _upload_one(client, dest / f.path, bucket, prefix + f.path, {"sha256": f.sha256})
        uploaded.append(f.model_copy(update={"s3_uri": f"s3://{bucket}/{prefix}{f.path}"}))
    manifest = manifest.model_copy(update={"s3_prefix": s3_prefix, "files": tuple(uploaded)})
    _write(manifest, dest)
    _upload_one(client, dest / MANIFEST, bucket, prefix + MANIFEST)
    return manifest


def parse_s3_prefix(s3_prefix: str, field: str = "s3_prefix") -> tuple[str, str]:
    """s3://bucket/some/prefix -> ('bucket', 'some/prefix/'); ValueError naming `field` and the
    fix for anything else (another scheme, no bucket, a name S3 refuses)."""
    parts = urlsplit(s3_prefix)
    example = "e.g. 's3://ml-artifacts/berth'"
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"{field} must be s3://bucket/prefix, got {s3_prefix!r}; {example}")
    if not BUCKET_RE.fullmatch(parts.netloc) or ".." in parts.netloc:
        raise ValueError(
            f"{field}: {parts.netloc!r} is not a valid S3 bucket name (3-63 lowercase letters, "
            f"digits, '.' and '-', starting and ending with a letter or digit); {example}"
        )
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def _expand(
    workdir: Path, patterns: Sequence[str], dest: Path
) -> tuple[dict[str, Path], list[str], list[Skipped]]:
    """Files matched by the patterns, by relative path; patterns with no match; skipped paths."""
    root = workdir.resolve()
    found: dict[str, Path] = {}
    missing: list[str] = []
    skipped: list[Skipped] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern, root_dir=workdir, recursive=True))
            matches = [workdir / p for p in matches]
        else:
            matches = [workdir / pattern] if os.path.lexists(workdir / pattern) else []
        if not matches:
            missing.append(pattern)
        for match in matches:
            for path in _files_under(match):
                rel = path.relative_to(workdir).as_posix()
                real = path.resolve()
                if not real.is_relative_to(root):
                    skipped.append(Skipped(path=rel, reason="links outside the working directory"))
                elif real.is_relative_to(dest.resolve()):
                    continue  # dest inside workdir: never collect a collection into itself
                elif path.is_dir():
                    skipped.append(Skipped(path=rel, reason="a linked directory; not followed"))
                elif path.is_file():
                    found.setdefault(rel, path)
    return found, missing, skipped


def _files_under(path: Path) -> list[Path]:
    """Path itself, or every file and symlink below it for a real directory."""
    if path.is_symlink() or not path.is_dir():
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        base = Path(dirpath)
        links = [d for d in dirnames if (base / d).is_symlink()]
        out += [base / name for name in sorted(filenames) + sorted(links)]
        dirnames.sort()
    return out


def _copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Copy through a temporary file (no half-written artifact under its real name)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    h, size = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    try:
        with src.open("rb") as r, os.fdopen(fd, "wb") as w:
            while chunk := r.read(CHUNK):
                w.write(chunk)
                h.update(chunk)
                size += len(chunk)
        os.replace(tmp, dst)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return size, h.hexdigest()


def _write(manifest: ArtifactManifest, dest: Path) -> None:
    write_meta(dest / MANIFEST, manifest.model_dump(mode="json"))


def _same_object(client: Any, bucket: str, key: str, f: ArtifactFile) -> bool:
    """Whether `key` already holds this file (same size, same sha256 in its metadata)."""
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except _S3_ERRORS:
        return False  # absent (404), or unreadable: upload it, and let the upload say why
    same_sha = head.get("Metadata", {}).get("sha256") == f.sha256
    return same_sha and head.get("ContentLength") == f.size


def _upload_one(
    client: Any, path: Path, bucket: str, key: str, metadata: dict[str, str] | None = None
) -> None:
    extra = {"Metadata": metadata} if metadata else None
    try:
        client.upload_file(str(path), bucket, key, ExtraArgs=extra)
    except (*_S3_ERRORS, OSError) as e:
        raise ArtifactError(
            f"upload of {path} to s3://{bucket}/{key} failed ({e}); {S3_FIX}; the artifacts "
            f"are kept in {path.parent}"
        ) from None
