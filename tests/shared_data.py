"""The shared data the tests read (the public Philly trace), found relative to the repository.

`shared/` lies beside the repository, in a developer's checkout and in CI's clone alike;
`BERTH_SHARED` names another folder holding `traces/`. With BERTH_REQUIRE_SHARED=1 (.ci/run
sets it) a missing trace fails the test that needs it instead of skipping it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def philly_dir() -> Path:
    """The folder holding philly.csv; skips the calling test (fails it in CI) when missing."""
    shared = Path(os.environ.get("BERTH_SHARED") or REPO.parent / "shared")
    folder = shared / "traces" / "philly"
    if not (folder / "philly.csv").is_file():
        message = (
            f"the Philly trace is not at {folder}: put shared/ beside the repository, or set "
            "BERTH_SHARED to the folder that holds traces/"
        )
        if os.environ.get("BERTH_REQUIRE_SHARED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return folder
