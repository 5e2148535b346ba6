"""A Python interpreter that has PyTorch, for the tests that run the DDP example for real.

The project does not install PyTorch (a training job brings its own, in its image or
environment), and PyPI's Linux wheels need gigabytes of CUDA libraries. The example runs under
whichever interpreter has it: this one, or the system's, where Debian's `python3-torch` (a CPU
build, 1.13: `apt-get install python3-torch`; `.ci/run` installs it) puts it. Without either the
importing test module skips, unless BERTH_REQUIRE_TORCH=1 (CI), where it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CANDIDATES = (sys.executable, "/usr/bin/python3")


def _has_torch(python: str) -> str | None:
    """The torch version `python` imports, or None."""
    try:
        done = subprocess.run(
            [python, "-c", "import torch, torch.distributed as d; "
             "assert d.is_available(); print(torch.__version__)"],
            capture_output=True, text=True, timeout=120, env={"PATH": os.environ.get("PATH", "")},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def torch_python() -> str:
    """The first interpreter of CANDIDATES with torch and torch.distributed; skips (or fails
    under BERTH_REQUIRE_TORCH=1) when there is none."""
    for python in CANDIDATES:
        if os.path.exists(python) and _has_torch(python):
            return python
    why = f"no interpreter with torch among {', '.join(CANDIDATES)} (apt-get install python3-torch)"
    if os.environ.get("BERTH_REQUIRE_TORCH") == "1":
        pytest.fail(f"BERTH_REQUIRE_TORCH=1 but {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)
