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


def _preempt(job: str, by: str) -> dict[str, str]:
    return {"type": "preempt", "job": job, "by": by}


def test_ping_pong_is_two_teams_taking_the_same_jobs_back_and_forth() -> None:
    submits = [{"type": "submit", "job": j, "team": t} for j, t in
               [("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", "c")]]  # fmt: skip
    back_and_forth = [_preempt("a1", "b1"), _preempt("b1", "a2")] * hunt.PING_PONG
    n = hunt.PING_PONG
    assert hunt.ping_pong(submits + back_and_forth) == (
        f"teams a and b took the same jobs back and forth: a1 taken by b {n} times, b1 by a {n}"
        " times"
    )
    one_turn_short = back_and_forth[:-1]
    assert hunt.ping_pong(submits + one_turn_short) is None
    one_way = [_preempt("a1", "b1"), _preempt("a2", "b1"), _preempt("c1", "b1")] * 20
    assert hunt.ping_pong(submits + one_way) is None  # a borrower reclaimed, again and again
    # Reclaims both ways as load moves, of other jobs each time: the quotas at work (a hunt
    # found berth-las-gpu at 5 and 5 between two teams, no job taken more than twice).
    many = [{"type": "submit", "job": f"{t}{i}", "team": t} for t in "ab" for i in range(n)]
    trading = [
        p for i in range(n) for p in (_preempt(f"a{i}", f"b{i}"), _preempt(f"b{i}", f"a{i}"))
    ]
    assert hunt.ping_pong(many + trading) is None
