"""What both benchmarks record besides their timings: the machine, the code, the console."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def machine() -> dict[str, Any]:
    """Python, OS, CPUs, and the load average: above the CPU count, other work shared them."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def reference_ms(repeat: int = 5) -> float:
    """Best of `repeat` runs of a fixed pure-Python workload (dicts, tuples, a sort), in ms.

    A yardstick for the machine's speed at the time: on a shared machine it varies from run to
    run with the neighbours' load, and so do the benchmarks; compare runs relative to it.
    """
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        table = {i: (i * 7919 % 1000, i) for i in range(50_000)}
        sorted(table.values())
        best = min(best, time.perf_counter() - started)
    return round(best * 1000, 2)


def code_version() -> dict[str, Any]:
    """The commit, whether scheduling/ differs from it, and a hash of scheduling/ as it is."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "scheduling").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    commit: str | None = None
    modified: bool | None = None
    try:
        commit = _git("rev-parse", "HEAD")
        modified = bool(_git("status", "--porcelain", "--", "scheduling"))
    except (OSError, subprocess.CalledProcessError):
        pass  # not a git checkout: the hash still identifies the code
    return {
        "commit": commit,
        "scheduling_modified": modified,
        "scheduling_sha256": digest.hexdigest()[:16],
    }


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
    )
    return done.stdout.strip()


def console_for_tables() -> Console:
    """stdout; wide enough for the tables' columns when it is a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=150)


def write_report(
    report: dict[str, Any],
    out: Path,
    console: Console,
    table: Callable[[dict[str, Any]], RenderableType],
) -> dict[str, Any]:
    """Write a benchmark's JSON to `out`, print its table and where it went; returns it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(table(report))
    console.print(f"wrote {out}")
    return report
