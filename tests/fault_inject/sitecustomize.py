"""A launch that stops mid-launch, for tests/test_triggerer_failover.py to kill its launcher.

Python imports `sitecustomize` at start-up from the first folder on sys.path that holds one;
that test puts this folder on the PYTHONPATH of its own triggerers alone, and nothing here acts
unless BERTH_TEST_PAUSE_LAUNCH is set too, to `{"job": NAME, "marker": PATH}`. Then, when
`berth.runtime.local` is imported, `LocalRuntime._spawn` is wrapped: in attempt 1 of the first
launch of a gang named NAME (job ids are `<name>-<12 hex>`), once rank 0 has started (its
wrapper wrote its pid file), the launching process writes PATH (`{"pid", "job_id", "rank0"}`)
and that launch blocks for good, the claim's renewal still running beside it: a launcher alive
but stuck, until the test kills it. "First" holds across processes (an O_EXCL file next to
PATH), so the triggerer that takes over, which loads this too, launches normally.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

TARGET = "berth.runtime.local"


def _patch(module: Any, job: str, marker: Path) -> None:
    from berth.runtime import shim

    spawn = module.LocalRuntime._spawn

    def spawn_then_pause(self: Any, launch: Any, rep: Any, env: dict[str, str]) -> None:
        spawn(self, launch, rep, env)
        ours = launch.job_id.startswith(f"{job}-") and launch.attempt == 1
        if not (ours and rep.rank == 0 and len(launch.replicas) > 1 and _first(marker)):
            return
        pid_file = shim.pid_file(Path(launch.dir), 0)
        deadline = time.monotonic() + 60
        while (started := shim.read_json(pid_file)) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the wrapper reports its pid within moments
        done = {"pid": os.getpid(), "job_id": launch.job_id, "rank0": (started or {}).get("pid")}
        shim.write_json_atomic(marker, done)
        threading.Event().wait()  # until this process is killed

    module.LocalRuntime._spawn = spawn_then_pause


def _first(marker: Path) -> bool:
    try:
        os.close(os.open(f"{marker}.taken", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class _PatchOnImport:
    """A meta path finder that finds TARGET as usual and patches it once it has run."""

    def __init__(self, job: str, marker: Path) -> None:
        self.job, self.marker = job, marker

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_then_patch(module: Any) -> None:
            run(module)
            _patch(module, self.job, self.marker)

        spec.loader.exec_module = run_then_patch  # type: ignore[method-assign]
        return spec


if wanted := os.environ.get("BERTH_TEST_PAUSE_LAUNCH"):
    config = json.loads(wanted)
    sys.meta_path.insert(0, _PatchOnImport(config["job"], Path(config["marker"])))
