"""Scenarios that fresh examples found the audit wrong on (`tests/data/audit_fixed/`, each file
says its cause), kept so that it stays right; and the nominal-deficit rule under per-model
quotas, on hand-built logs: still flagged where the lender's job is within its nominal of the
model, not where it would borrow the model."""

from __future__ import annotations

from pathlib import Path

import pytest
from audit_logs import CLUSTER, admit, ev
from scenario_gen import TOPOLOGY_AWARE, _simulate
from test_audit_deficit import A1, B1, B2, BOUNDED, DUE, WHOLE, C, lent_out
from test_shortcuts import _load

from scheduling.config import parse_teams
from scheduling.simulator.audit import audit, audit_or_raise

FOUND = sorted((Path(__file__).parent / "data" / "audit_fixed").glob("*.json"))


@pytest.mark.parametrize("path", FOUND, ids=[p.stem for p in FOUND])
def test_scenarios_the_audit_was_wrong_on_pass_it(path: Path) -> None:
    """Each failed the audit before its fix, under the policy the file names at least."""
    s = _load(path)
    for name in TOPOLOGY_AWARE:
        result = _simulate(s, name)
        audit_or_raise(result.events, s.cluster, s.teams, s.policy(name), s.jobs)


def _deficits(a_model_nominal: int, b_nominal: int = 4) -> list[tuple[float, str, str]]:
    """`test_audit.lent_out`'s log (b1 and b2 of b on n0 and n1, c on n2; a1, 4 GPUs, waits
    from t=10 and is served only when b's jobs end) with a declaring `gpus.gpu` (the nodes'
    model): b and c, with no key for it, have a nominal of 0 of it."""
    teams = parse_teams(
        [
            {"name": "a", "nominal": {"gpus": 4, "gpus.gpu": a_model_nominal}},
            {"name": "b", "nominal": {"gpus": b_nominal}},
            {"name": "c", "nominal": {"gpus": 4}},
        ]
    )
    events = [
        *lent_out(),
        *(ev(5500, "finish", j) for j in (B1, B2, C)),
        admit(5500, A1, WHOLE[0], level="node"),
        ev(5610, "finish", A1),
    ]
    jobs = {j.job_id: j for j in (A1, B1, B2, C)}
    return [(v.t, v.job, v.rule) for v in audit(events, CLUSTER, teams, BOUNDED, jobs)]


def test_the_deficit_rule_owes_a_model_reclaim_within_the_teams_nominal_of_the_model() -> None:
    assert _deficits(4) == [(DUE, "a1", "nominal_deficit")]


@pytest.mark.parametrize("a_model_nominal", [0, 2])
def test_the_deficit_rule_owes_nothing_where_the_job_would_borrow_the_model(
    a_model_nominal: int,
) -> None:
    # a's 4-GPU job on the only model goes beyond a's nominal of it: it would borrow the
    # model (b and c have a nominal of 0 of it, so b borrows it too), and no reclaim is owed.
    assert _deficits(a_model_nominal) == []


def test_the_deficit_rule_owes_a_model_reclaim_from_a_team_within_its_total_nominal() -> None:
    # b (nominal 8) borrows nothing in total, but all 8 of its GPUs of the model: a's job,
    # within a's nominal of the model, is owed them (scheduling/model_reclaim.py).
    assert _deficits(4, b_nominal=8) == [(DUE, "a1", "nominal_deficit")]
    # Beyond a's nominal of the model, a1 would borrow it: nothing is owed.
    assert _deficits(2, b_nominal=8) == []
