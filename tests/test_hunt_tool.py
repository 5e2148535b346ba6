"""tools/hunt.py: the parallel fresh-example hunt reports a failing seed with its scenario."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import hunt


def test_a_seed_passes_and_a_planted_violation_is_reported_with_its_scenario(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran, failed = hunt._one_seed(7)
    assert 0 < ran <= 60 and failed is None

    def planted(*args: object, **kwargs: object) -> None:
        raise AssertionError("1 violation(s), policy berth: planted")

    monkeypatch.setattr("scheduling.simulator.audit.audit_or_raise", planted)
    _, failed = hunt._one_seed(7)
    assert failed is not None
    assert failed.startswith("seed 7\n") and "planted" in failed and "Scenario(" in failed
