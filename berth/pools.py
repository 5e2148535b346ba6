"""Team pools: one Airflow pool per team, `berth-<team>`, as many slots as GPUs it may reach.

The pools mirror the quotas (docs/decisions/0005): a run task takes one slot per GPU of its
gang; deferred tasks do not count (`include_deferred=False`): with them counted, a run task
whose trigger fired goes to `scheduled`, loses its slot to a new task (apache/airflow#69187)
and cannot resume to release the GPUs that new task waits for: a deadlock our end-to-end test
found. A pool's size is the team's reach (nominal + borrowing limit, capped at the cluster).

Synced over Airflow's REST API (`POST /auth/token` for a JWT, then `/api/v2/pools`), so it works
the same against `airflow standalone` and a Helm-deployed Airflow. Run it as
`berth pools sync --api-url http://localhost:8080 --username admin --password ...`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from scheduling.cluster import Cluster
from scheduling.quota import Team
from scheduling.resources import GPU_UNIT

POOL_PREFIX = "berth-"
# The trigger form's defaults for the fields that size a run's pool slots (operators/params.py
# builds the form with them; the cluster policy reads a conf that leaves them out with them).
CONF_DEFAULTS = {"replicas": 1, "gpus_per_replica": 1}


class PoolSyncError(RuntimeError):
    """The Airflow API refused a call; the message says which and what to check."""


def pool_name(team: str) -> str:
    return f"{POOL_PREFIX}{team}"


def pool_for_conf(conf: object) -> tuple[str, int] | None:
    """(pool, slots) of the run task of a job launched with `conf` (the trigger form's or the
    REST API's), or None when the conf names no team or its sizes are bad (the validate task
    names the problem): slots = the gang's GPUs, a share rounded up to one, as for a job
    written in a DAG file (operators/retries.py)."""
    if not isinstance(conf, Mapping) or not isinstance(conf.get("team"), str):
        return None
    try:
        replicas = int(conf.get("replicas", CONF_DEFAULTS["replicas"]))
        gpus = float(conf.get("gpus_per_replica", CONF_DEFAULTS["gpus_per_replica"]))
    except (TypeError, ValueError):
        return None
    if replicas < 1 or not 0 < gpus < math.inf:
        return None
    return pool_name(conf["team"]), max(1, math.ceil(replicas * gpus))


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    slots: int
    description: str


def team_pools(teams: Mapping[str, Team], cluster: Cluster) -> list[PoolSpec]:
    """The pool each team should have: slots = reachable GPUs, whole, at most the cluster's."""
    total = cluster.total.gpu
    out = []
    for name, team in sorted(teams.items()):
        reach = min(team.ceiling.gpu, total)
        slots = max(1, math.floor(reach / GPU_UNIT))  # Airflow needs >= 1 slot to run anything
        desc = (
            f"Berth team {name}: GPUs it may hold (nominal {_gpus(team.nominal.gpu, total)} + "
            f"borrowing, capped at the cluster's {total // GPU_UNIT}); one slot per GPU"
        )
        out.append(PoolSpec(pool_name(name), slots, desc))
    return out


def _gpus(milli: int, cap: int) -> str:
    return f"{min(milli, cap) / GPU_UNIT:g}"


def sync_pools(
    api_url: str,
    username: str,
    password: str,
    teams: Mapping[str, Team],
    cluster: Cluster,
    *,
    timeout_s: float = 30.0,
) -> dict[str, str]:
    """Create or update every team's pool; returns {pool: "created" | "updated" | "unchanged"}."""
    base = api_url.rstrip("/")
    with httpx.Client() as http:
        http.headers["Authorization"] = (
            f"Bearer {_token(http, base, username, password, timeout_s)}"
        )
        done = {}
        for pool in team_pools(teams, cluster):
            body = {
                "name": pool.name,
                "slots": pool.slots,
                "description": pool.description,
                "include_deferred": False,  # see the module doc: a deadlock otherwise
            }
            url = f"{base}/api/v2/pools/{quote(pool.name, safe='')}"
            got = http.get(url, timeout=timeout_s)
            if got.status_code == 404:
                _check(http.post(f"{base}/api/v2/pools", json=body, timeout=timeout_s), "create")
                done[pool.name] = "created"
                continue
            _check(got, "read")
            have = got.json()
            if all(have.get(k) == v for k, v in body.items()):
                done[pool.name] = "unchanged"
                continue
            # PATCH takes the whole pool, its name under "pool" (Airflow's PoolPatchBody).
            changes = {"pool": pool.name, **{k: v for k, v in body.items() if k != "name"}}
            _check(http.patch(url, json=changes, timeout=timeout_s), "update")
            done[pool.name] = "updated"
        return done


def _token(http: httpx.Client, base: str, user: str, password: str, timeout_s: float) -> str:
    r = http.post(
        f"{base}/auth/token", json={"username": user, "password": password}, timeout=timeout_s
    )
    if r.status_code in (401, 403):
        raise PoolSyncError(
            f"{base}/auth/token refused user {user!r} ({r.status_code}); check --username and "
            "--password (scripts/airflow.sh prints them)"
        )
    _check(r, "log in")
    return r.json()["access_token"]


def _check(r: httpx.Response, what: str) -> None:
    if r.status_code >= 400:
        raise PoolSyncError(
            f"could not {what} a pool: {r.request.method} {r.url} -> {r.status_code} "
            f"{r.text[:300]}; the user needs the Admin role to manage pools"
        )
