"""A local spool of tracking writes that could not reach the MLflow server.

The platform's own record of an attempt (its final status and the metrics it measured) is
written after the job ran, when losing it would lose the only account of what happened. So a
write that fails, after the MLflow client's own HTTP retries, is appended here as one JSON line
and replayed, in order, by the next `JobTracker.flush()` (every tracker call starts with one).
Replays are idempotent: metrics carry their timestamps, tags and statuses overwrite.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock


class Spool:
    """Append-only JSON lines, one file per process group of writers, guarded by a file lock."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "pending.jsonl"
        self._lock = FileLock(str(directory / "pending.lock"))

    def append(self, op: str, **args: Any) -> None:
        line = json.dumps({"op": op, "args": args}, sort_keys=True)
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def __len__(self) -> int:
        return sum(1 for _ in self._entries())

    def _entries(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

    def replay(self, apply: Callable[[str, dict[str, Any]], None]) -> int:
        """Apply the spooled writes in order; keep the first that fails and all after it.

        Returns how many were applied. `apply` raising stops the replay (the server is still
        away): the rest stay, in order, for the next call."""
        with self._lock:
            entries = list(self._entries())
            done = 0
            try:
                for entry in entries:
                    apply(entry["op"], entry["args"])
                    done += 1
            finally:
                rest = entries[done:]
                tmp = self.path.with_suffix(".tmp")
                with tmp.open("w", encoding="utf-8") as f:
                    for entry in rest:
                        f.write(json.dumps(entry, sort_keys=True) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                tmp.replace(self.path)
        return done
