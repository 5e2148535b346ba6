"""The audit's nominal-deficit bound (scheduling/simulator/audit_deficit.py): a job within its
team's nominal left waiting past the bound while one borrowed job could make room for it, on
hand-built event logs (audit_logs.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from audit_logs import (
    BERTH,
    CLUSTER,
    TEAMS_LOOSE,
    admit,
    ev,
    job,
    rep,
    submit,
)

from scheduling.simulator.audit import audit
from scheduling.simulator.trace import TraceJob

# -- the nominal-deficit bound ----------------------------------------------------------------

# Berth with a deadline on the guards: a job within its team's nominal gets borrowed quota
# back within max(preemption delay, deadline) + a victim's minimum run time. The knobs are
# spelled out so that the tests do not move with berth's defaults.
BOUNDED = replace(
    BERTH,
    name="berth-bounded",
    preemption_delay_s=600.0,
    min_runtime_s=600.0,
    reclaim_deadline_s=1800.0,
)
UNBOUNDED = replace(BOUNDED, name="berth-unbounded", reclaim_deadline_s=math.inf)
DUE = 10 + BOUNDED.reclaim_bound_s  # a1 below waits from t=10
B1, B2 = job("b1", "b", gpus=4, duration=5000), job("b2", "b", gpus=4, duration=5000)
C, A1 = job("c", "c", gpus=4, duration=5000), job("a1", gpus=4)
WHOLE = [rep(n, 0, 1, 2, 3) for n in ("n0", "n1", "n2")]


def lent_out() -> list[dict]:
    """b borrows all of a's quota: b1 on n0 and b2 on n1 (b's nominal is 4 GPUs); c holds
    its nominal on n2. a1 (4 GPUs, within a's nominal) waits from t=10: either b job could
    go (b keeps its nominal), and n0 or n1 would then hold a1."""
    return [
        *(submit(0, j) for j in (B1, B2, C)),
        *(admit(0, j, r, level="node") for j, r in zip((B1, B2, C), WHOLE, strict=True)),
        submit(10, A1),
    ]


def deficits(events: list[dict], jobs: list[TraceJob], policy: Any = BOUNDED) -> list:
    found = audit(events, CLUSTER, TEAMS_LOOSE, policy, {j.job_id: j for j in jobs})
    return [(v.t, v.job, v.rule, v.message) for v in found]


def test_the_bound_is_the_deadline_then_a_victims_minimum_run_time() -> None:
    assert DUE == 10 + 1800 + 600
    assert math.isinf(UNBOUNDED.reclaim_bound_s)


def test_a_lender_served_before_the_bound() -> None:
    # At 610 (a1's preemption delay over, b1 past its minimum run time) a1 reclaims b1.
    events = [
        *lent_out(),
        ev(610, "preempt", B1, by="a1"),
        admit(610, A1, WHOLE[0], level="node"),
        ev(720, "finish", A1),
        admit(720, B1, WHOLE[0], level="node"),
        ev(5500, "finish", B2),
        ev(5500, "finish", C),
        ev(6220, "finish", B1),
    ]
    assert deficits(events, [A1, B1, B2, C]) == []


def test_a_lender_left_waiting_past_the_bound_with_nothing_happening() -> None:
    # Nothing is logged between a1's submission and the end of b's jobs at 5500: the engine
    # had to wake up and reclaim by 2410, and did not.
    events = [
        *lent_out(),
        *(ev(5500, "finish", j) for j in (B1, B2, C)),
        admit(5500, A1, WHOLE[0], level="node"),
        ev(5610, "finish", A1),
    ]
    [(t, who, rule, message)] = deficits(events, [A1, B1, B2, C])
    assert (t, who, rule) == (DUE, "a1", "nominal_deficit")
    assert "could go from n0" in message and "nothing was logged from then to t=5500" in message
    assert deficits(events, [A1, B1, B2, C], UNBOUNDED) == []  # no bound promised


def test_a_lender_left_waiting_past_the_bound_by_a_cycle_that_does_something_else() -> None:
    # c's jobs: c2 ends at 2410 and c3, waiting since 20, takes its GPUs in that cycle.
    # a1 was due then: the cycle should have reclaimed b1 or b2 for it first.
    c1, c2 = job("c1", "c", gpus=2, duration=5000), job("c2", "c", gpus=2, duration=2410)
    c3 = job("c3", "c", gpus=2, duration=1000)
    events = [
        *(submit(0, j) for j in (B1, B2, c1, c2)),
        *(admit(0, j, r, level="node") for j, r in zip((B1, B2), WHOLE[:2], strict=True)),
        admit(0, c1, rep("n2", 0, 1)),
        admit(0, c2, rep("n2", 2, 3)),
        submit(10, A1),
        submit(20, c3),
        ev(2410, "finish", c2),
        admit(2410, c3, rep("n2", 2, 3)),
        ev(3410, "finish", c3),
        ev(5000, "finish", c1),
        *(ev(5500, "finish", j) for j in (B1, B2)),
        admit(5500, A1, WHOLE[0], level="node"),
        ev(5610, "finish", A1),
    ]
    [(t, who, rule, message)] = deficits(events, [A1, B1, B2, c1, c2, c3])
    assert (t, who, rule) == (DUE, "a1", "nominal_deficit")
    assert "nothing was logged" not in message
    # Served in that cycle instead, a1 is not late.
    served = [
        *events[:11],
        ev(2410, "preempt", B2, by="a1"),
        admit(2410, A1, WHOLE[1], level="node"),
        admit(2410, c3, rep("n2", 2, 3)),
        ev(2520, "finish", A1),
        admit(2520, B2, WHOLE[1], level="node"),
        ev(3410, "finish", c3),
        ev(5000, "finish", c1),
        ev(5500, "finish", B1),
        ev(8020, "finish", B2),
    ]
    assert deficits(served, [A1, B1, B2, c1, c2, c3]) == []


def test_a_team_borrowing_through_one_big_job_keeps_it() -> None:
    # b borrows 2 GPUs through b4, a 4-GPU job: taking it would leave b with 2 of its 4
    # GPUs, and b's other job is not preemptible. a1 (2 GPUs) waits for b4 to end.
    b2 = job("b2", "b", gpus=2, duration=5000, preemptible=False)
    b4 = job("b4", "b", gpus=4, duration=5000)
    a0, a1 = job("a0", gpus=2, duration=5000), job("a1", gpus=2)
    c1, c2 = job("c1", "c", gpus=2, duration=5000), job("c2", "c", gpus=2, duration=5000)

    def log(b2: TraceJob) -> list[dict]:
        return [
            *(submit(0, j) for j in (b2, b4, a0, c1, c2)),
            admit(0, b2, rep("n1", 0, 1)),
            admit(0, b4, WHOLE[0], level="node"),
            admit(0, a0, rep("n2", 0, 1)),
            admit(0, c1, rep("n1", 2, 3)),
            admit(0, c2, rep("n2", 2, 3)),
            submit(10, a1),
            *(ev(5000, "finish", j) for j in (b2, a0, c1, c2)),
            admit(5000, a1, rep("n1", 0, 1)),
            ev(5100, "finish", a1),
            ev(5500, "finish", b4),
        ]

    assert deficits(log(b2), [a0, a1, b2, b4, c1, c2]) == []
    # Were b2 preemptible, it could go (b keeps its 4 GPUs) and free n1 for a1.
    b2 = replace(b2, preemptible=True)
    found = deficits(log(b2), [a0, a1, b2, b4, c1, c2])
    assert [(t, who, rule) for t, who, rule, _ in found] == [(DUE, "a1", "nominal_deficit")]
