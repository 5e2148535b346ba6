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


def test_a_worker_writes_each_failing_seed_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A hunt stopped from outside keeps what it found: each failing seed is in
    fails-<pid>.txt as soon as it fails, not only in fails.txt at the end."""
    calls: list[int] = []

    def one_seed(s0: int) -> tuple[int, str | None]:
        calls.append(s0)
        return 60, (f"seed {s0}\nplanted" if len(calls) % 2 else None)

    monkeypatch.setattr(hunt, "_one_seed", one_seed)
    monkeypatch.setattr(hunt, "_clock", iter([0.0, 1.0, 2.0, 3.0, 4.0, 99.0]).__next__)
    seeds, examples, fails = hunt._worker((5.0, tmp_path))
    assert (seeds, examples) == (4, 240) and len(fails) == 2
    [written] = tmp_path.glob("fails-*.txt")
    assert written.read_text().count("planted") == 2
    assert all(f"seed {s}" in written.read_text() for s in calls[::2])
