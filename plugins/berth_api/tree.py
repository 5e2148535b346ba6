"""The organization tree as the API shows it: every cohort with its quota and what its subtree
uses now (docs/decisions/0023).

The quotas are the engine's own (`scheduling.cohorts.Cohort`, worked out when the teams file
is read). What each cohort uses is what the engine's ledger counts: the teams' GPUs held are
added to a fresh `QuotaLedger`, which carries each team's use beyond its guaranteed part up
its cohorts as the scheduling cycle does, so the page and the engine cannot disagree on
whether a department borrows.
"""

from __future__ import annotations

from collections.abc import Mapping

from berth.store import TeamUsage
from berth.store.views import gpus_of
from plugins.berth_api.models import Cohort
from scheduling.quota import QuotaLedger, Team
from scheduling.resources import UNLIMITED, Resources


def cohort_tree(teams: Mapping[str, Team], usage: Mapping[str, TeamUsage]) -> list[Cohort]:
    """Each cohort of the teams' tree, each parent before its children and siblings by name;
    `usage`: the store's per team (`Store.usage`). Empty without a tree."""
    nodes = {c.name: c for t in teams.values() for c in t.cohorts}
    if not nodes:
        return []
    ledger = QuotaLedger(teams)
    for name, u in usage.items():
        if name in teams:
            ledger.add(name, Resources.of(gpus=u.gpus))
    children: dict[str | None, list[str]] = {}
    for c in nodes.values():
        children.setdefault(c.parent, []).append(c.name)
    direct: dict[str, list[str]] = {}  # cohort -> the teams directly in it
    held: dict[str, float] = {}  # cohort -> GPUs held by the teams anywhere under it
    for name, t in teams.items():
        if t.cohorts:
            direct.setdefault(t.cohorts[0].name, []).append(name)
        for c in t.cohorts:
            held[c.name] = held.get(c.name, 0.0) + (usage[name].gpus if name in usage else 0.0)
    out: list[Cohort] = []

    def walk(parent: str | None) -> None:
        for name in sorted(children.get(parent, ())):
            c = nodes[name]
            used = ledger.cohort_used.get(name, Resources()).gpu
            out.append(
                Cohort(
                    name=name,
                    parent=c.parent,
                    nominal_gpus=_gpus(c.nominal.gpu),
                    quota_gpus=_gpus(c.quota.gpu),
                    guaranteed_gpus=_gpus(c.guaranteed.gpu),
                    lending_limit_gpus=None
                    if c.lending_limit is None
                    else _gpus(c.lending_limit.gpu),
                    borrowing_limit_gpus=_gpus(c.borrowing_limit.gpu),
                    ceiling_gpus=_gpus(c.ceiling.gpu),
                    held_gpus=held.get(name, 0.0),
                    used_gpus=gpus_of(used),
                    borrowed_gpus=gpus_of(max(0, used - c.quota.gpu)),
                    weight=c.weight,
                    cohorts=sorted(children.get(name, ())),
                    teams=sorted(direct.get(name, ())),
                )
            )
            walk(name)

    walk(None)
    return out


def _gpus(milli: int) -> float | None:
    """GPUs, or None for a quota that does not limit them."""
    return None if milli >= UNLIMITED else gpus_of(milli)
