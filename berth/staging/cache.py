"""The content-addressed cache that staged inputs live in, shared by every job on a machine.

Layout under the cache directory:

    entries/<key>/<name>         the payload: a file, or a directory tree (what a replica reads)
    entries/<key>.meta.json      uri, key, name, kind, size, sha256, fetched_at (written last)
    locks/<key>.lock             a `filelock.FileLock`: one process fills or checks a key at a time

An entry is valid only when its meta file exists and the payload's size and sha256 match it, so
a download cut short, a disk error or a hand edit is found and the entry refetched. Payloads are
written under a temporary name in the entry's own directory and renamed into place, so a reader
never sees half a file. Lock files are never deleted: a process waiting on a deleted lock file
would hold a lock that a newcomer, opening the path afresh, does not see.

The meta file's modification time is the entry's last use (touched on every reuse): access times
are unreliable on filesystems mounted with noatime/relatime.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock, Timeout

CHUNK = 1 << 20
Kind = Literal["file", "tree"]


class CacheError(Exception):
    """A payload did not match what its source promised (size or sha256), even after a retry."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A valid cache entry: where its payload is and what it holds."""

    key: str
    path: Path
    kind: Kind
    size: int
    sha256: str
    fetched: bool  # False: reused from an earlier stage, nothing was transferred


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of one file."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def tree_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative posix path, path) of every regular file under root, in a stable order.

    Symlinked directories are not followed (a link cycle, or a link out of the tree, would make
    the hash depend on things outside the input); symlinked files are read through.
    """
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames):
            p = base / name
            if p.is_file():
                yield p.relative_to(root).as_posix(), p


def tree_digest(root: Path) -> tuple[int, str]:
    """(total bytes, sha256 hex) of a directory tree, over relative paths and file contents.

    Each file contributes its path, size and own sha256, so that moving bytes from one file to
    the next changes the digest.
    """
    h = hashlib.sha256(b"berth-tree-v1\0")
    total = 0
    for rel, p in tree_files(root):
        size, digest = file_digest(p)
        h.update(f"{rel}\0{size}\0{digest}\n".encode())
        total += size
    return total, h.hexdigest()


def digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file or of a directory tree (`tree_digest`)."""
    return tree_digest(path) if path.is_dir() else file_digest(path)


def identity_key(*parts: object) -> str:
    """A filesystem-safe cache key from the parts that identify some content."""
    text = "\0".join(str(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


class ContentCache:
    """Entries keyed by content identity under one directory; safe across processes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.entries = self.root / "entries"
        self.locks = self.root / "locks"
        self.entries.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)

    def lock(self, key: str) -> FileLock:
        return FileLock(self.locks / f"{key}.lock")

    def meta_path(self, key: str) -> Path:
        return self.entries / f"{key}.meta.json"

    def lookup(self, key: str, *, verify: bool = True) -> Entry | None:
        """The entry for `key` if it is valid (sha256 checked when `verify`), else None.

        Call with the key's lock held, or accept that the entry may change meanwhile.
        """
        meta = read_meta(self.meta_path(key))
        if meta is None:
            return None
        path = self.entries / key / meta["name"]
        if not path.exists():
            return None
        if verify:
            size, sha = digest(path)
        else:
            size, sha = _quick_size(path), meta["sha256"]
        if size != meta["size"] or sha != meta["sha256"]:
            return None
        return Entry(key, path, meta["kind"], size, sha, fetched=False)

    def ensure(
        self,
        key: str,
        name: str,
        fill: Callable[[Path], None],
        *,
        uri: str,
        expected_size: int | None = None,
        expected_sha256: str | None = None,
        verify_cached: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> Entry:
        """The valid entry for `key`, calling `fill(tmp_path)` to create it when missing or bad.

        Holding the key's lock, so that of two processes staging the same content one fills and
        the other waits and reuses. `fill` writes the payload (a file, or a directory) at the
        path it is given; the result is checked against `expected_size` / `expected_sha256`
        where known, and filled once more before giving up with a CacheError.
        """
        with self.lock(key):
            found = self.lookup(key, verify=verify_cached)
            if found is not None:
                os.utime(self.meta_path(key))  # last use, for prune's LRU order
                return found
            self._discard(key)
            problem = ""
            for _ in range(2):  # a second try absorbs a transfer that went wrong once
                entry, problem = self._fill(key, name, fill, expected_size, expected_sha256)
                if entry is not None:
                    write_meta(
                        self.meta_path(key),
                        {
                            "uri": uri,
                            "key": key,
                            "name": name,
                            "kind": entry.kind,
                            "size": entry.size,
                            "sha256": entry.sha256,
                            "fetched_at": datetime.now(UTC).isoformat(),
                            **(extra or {}),
                        },
                    )
                    return entry
            raise CacheError(problem)

    def _fill(
        self,
        key: str,
        name: str,
        fill: Callable[[Path], None],
        expected_size: int | None,
        expected_sha256: str | None,
    ) -> tuple[Entry | None, str]:
        entry_dir = self.entries / key
        entry_dir.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.part-", dir=entry_dir))
        payload = tmp / name
        try:
            fill(payload)
            size, sha = digest(payload)
            if expected_size is not None and size != expected_size:
                return None, f"got {size} bytes, expected {expected_size}"
            if expected_sha256 is not None and sha != expected_sha256:
                return None, f"got sha256 {sha}, expected {expected_sha256}"
            final = entry_dir / name
            _remove(final)
            os.replace(payload, final)
            kind: Kind = "tree" if final.is_dir() else "file"
            return Entry(key, final, kind, size, sha, fetched=True), ""
        finally:
            _remove(tmp)

    def _discard(self, key: str) -> None:
        """Remove an invalid entry: its meta first, so that no one trusts the payload meanwhile."""
        self.meta_path(key).unlink(missing_ok=True)
        _remove(self.entries / key)


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What `prune` removed, what it kept, and what it skipped because it was in use."""

    removed: tuple[str, ...]
    freed_bytes: int
    kept_bytes: int
    busy: tuple[str, ...]


def prune(cache_dir: Path, max_bytes: int) -> PruneResult:
    """Remove least recently used entries until the cache holds at most `max_bytes`.

    Entries whose lock another process holds (being staged or checked right now) are skipped;
    incomplete entries (no meta: a download that died) are removed first, since nothing can use
    them. A job may still be reading an entry that is not locked: size the cache so that what
    running jobs read is among the most recently used.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}; give the cache's size limit")
    cache = ContentCache(cache_dir)
    sized: list[tuple[float, str, int]] = []  # (last use, key, bytes); no meta sorts first
    for entry_dir in cache.entries.iterdir():
        if not entry_dir.is_dir():
            continue
        key = entry_dir.name
        meta_file = cache.meta_path(key)
        try:
            last_use = meta_file.stat().st_mtime
        except FileNotFoundError:
            last_use = float("-inf")
        sized.append((last_use, key, _disk_size(entry_dir)))
    sized.sort()
    total = sum(size for _, _, size in sized)
    removed, busy, freed = [], [], 0
    for _, key, size in sized:
        if total <= max_bytes:
            break
        try:
            with cache.lock(key).acquire(timeout=0):
                cache._discard(key)
        except Timeout:
            busy.append(key)
            continue
        removed.append(key)
        freed += size
        total -= size
    return PruneResult(tuple(removed), freed, total, tuple(busy))


def read_meta(path: Path) -> dict[str, Any] | None:
    """The meta record, or None when it is missing or unreadable (the entry is then invalid)."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    needed = {"name": str, "kind": str, "size": int, "sha256": str}
    if not isinstance(meta, dict) or any(not isinstance(meta.get(k), t) for k, t in needed.items()):
        return None
    return meta


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    """Write the meta record atomically (temp file in the same directory, then rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _quick_size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for _, p in tree_files(path))
    return path.stat().st_size


def _disk_size(path: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
