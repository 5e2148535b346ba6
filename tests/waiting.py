"""Waiting in tests for what other processes and threads do: poll, never sleep blindly."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(
    cond: Callable[[], Any],
    what: str,
    timeout: float = 30.0,
    every: float = 0.05,
    *,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Call `cond` until it returns something truthy, and return that; fail the test naming
    `what` after `timeout` seconds, with `detail()` (e.g. the last error seen, a log's tail)
    when given. `every` only paces the polling."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            more = f"\n{detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}{more}")
        time.sleep(every)
    return value
