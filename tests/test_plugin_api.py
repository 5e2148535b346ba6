"""The Berth plugin's REST API against a real store (tests/plugin_api_kit.py: the history, the
app mounted as Airflow mounts it, Airflow's login swapped for a user who may do anything except
in the test that checks it is asked for). Its metrics: test_plugin_metrics.py; the plugin in a
real Airflow: test_plugin_in_airflow.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow._shared.module_loading.file_discovery import find_path_from_directory
from builders import cluster, job_spec
from fastapi.testclient import TestClient
from plugin_api_kit import (  # noqa: F401 (fixtures)
    API,
    CLUSTER,
    FAST,
    REPO,
    History,
    borrow,
    by_name,
    client_fixture,
    get,
    history_fixture,
    mounted,
    reclaim,
    scrape,
    settle,
    store_fixture,
)

from berth.store import Store
from berth.store.views import ModelUsage, TeamUsage
from plugins.berth_api import models
from scheduling.config import parse_teams

# -- the API's answers ------------------------------------------------------------------------


def test_teams_show_held_borrowed_and_quota(store: Store, client: TestClient) -> None:
    borrow(store)
    rows = {t.team: t for t in models.Teams.model_validate(get(client, f"{API}/teams")).teams}
    assert rows["a"].model_dump() == {
        "team": "a",
        "nominal_gpus": 4.0,
        "ceiling_gpus": 8.0,
        "held_gpus": 8.0,
        "borrowed_gpus": 4.0,
        "stopping_gpus": 0.0,
        "queued": 0,
        "running": 2,
        "models": [],  # one GPU model, no model keys
        "cohorts": [],  # no organization tree
    }
    assert rows["b"].ceiling_gpus is None  # unlimited borrowing: null, not infinity
    assert rows["b"].held_gpus == 0.0 and rows["b"].borrowed_gpus == 0.0

    h = reclaim(store)
    rows = {t.team: t for t in models.Teams.model_validate(get(client, f"{API}/teams")).teams}
    assert (rows["a"].held_gpus, rows["a"].borrowed_gpus, rows["a"].stopping_gpus) == (4, 0, 4)
    assert (rows["b"].held_gpus, rows["b"].running) == (2.0, 1)
    settle(store, h)
    rows = {t.team: t for t in models.Teams.model_validate(get(client, f"{API}/teams")).teams}
    for name, u in store.usage().items():
        assert rows[name].held_gpus == u.gpus and rows[name].queued == u.queued
        assert rows[name].running == u.running
    assert (rows["b"].held_gpus, rows["b"].queued, rows["b"].running) == (2.5, 2, 2)


def test_a_team_shows_its_gpus_per_model_with_null_for_no_key_or_no_limit() -> None:
    u = TeamUsage(
        "a", 6.0, 8.0, 12.0, 0.0, 0, 2,
        models=(ModelUsage("H100", 4.0, 4.0, math.inf), ModelUsage("A100", 2.0, None, None)),
    )  # fmt: skip
    assert [m.model_dump() for m in models.Team.of(u).models] == [
        {"model": "H100", "held_gpus": 4.0, "nominal_gpus": 4.0, "ceiling_gpus": None},
        {"model": "A100", "held_gpus": 2.0, "nominal_gpus": None, "ceiling_gpus": None},
    ]


# Two levels: the research department (lends its parent at most 2 of its quota) holds the
# nlp team and the vision lab (its own 2 GPUs, borrows at most 4), which holds cv and speech
# (speech keeps 1 of its 2 GPUs: its lending limit is 1); ops sits at the root.
TREE = {
    "cohorts": [
        {"name": "research", "lending_limit": {"gpus": 2}},
        {
            "name": "vision-lab",
            "parent": "research",
            "nominal": {"gpus": 2},
            "borrowing_limit": {"gpus": 4},
        },
    ],
    "teams": [
        {"name": "cv", "nominal": {"gpus": 4}, "cohort": "vision-lab"},
        {
            "name": "speech",
            "nominal": {"gpus": 2},
            "lending_limit": {"gpus": 1},
            "cohort": "vision-lab",
        },
        {"name": "nlp", "nominal": {"gpus": 4}, "cohort": "research"},
        {"name": "ops", "nominal": {"gpus": 6}},
    ],
}


@pytest.fixture
def tree_store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path}/tree.db", cluster(nodes=2, gpus=8), parse_teams(TREE), FAST)
    yield s
    s.close()


def test_cohorts_show_each_levels_quota_use_and_borrowing(tree_store: Store) -> None:
    client = mounted(tree_store)
    idle = models.Cohorts.model_validate(get(client, f"{API}/cohorts")).cohorts
    assert [(c.name, c.held_gpus, c.used_gpus, c.borrowed_gpus) for c in idle] == [
        ("research", 0, 0, 0),
        ("vision-lab", 0, 0, 0),
    ]
    # cv 8 GPUs (4 above its nominal), speech 1 (within the part it keeps), nlp 2.
    for i, (name, team, gpus) in enumerate(
        [("cv1", "cv", 4), ("cv2", "cv", 4), ("sp", "speech", 1), ("nlp1", "nlp", 2)]
    ):
        tree_store.submit(job_spec(name, team, gpus), job_id=name, now=float(i))
    assert sorted(tree_store.schedule(now=5.0).admitted) == ["cv1", "cv2", "nlp1", "sp"]
    # Parents before their children.
    research, lab = (
        c.model_dump() for c in models.Cohorts.model_validate(get(client, f"{API}/cohorts")).cohorts
    )
    assert lab == {
        "name": "vision-lab",
        "parent": "research",
        "nominal_gpus": 2.0,
        "quota_gpus": 7.0,  # its own 2, cv's 4, the 1 speech lends
        "guaranteed_gpus": 0.0,  # no lending limit: it lends all of it
        "lending_limit_gpus": None,
        "borrowing_limit_gpus": 4.0,
        "ceiling_gpus": 11.0,
        "held_gpus": 9.0,
        "used_gpus": 8.0,  # cv's 8; speech's 1 is within the part it keeps
        "borrowed_gpus": 1.0,  # 8 used of a quota of 7: 1 from research's pool
        "weight": 1.0,
        "cohorts": [],
        "teams": ["cv", "speech"],
    }
    assert research == {
        "name": "research",
        "parent": None,
        "nominal_gpus": 0.0,
        "quota_gpus": 11.0,  # nlp's 4 and the lab's 7
        "guaranteed_gpus": 9.0,  # it lends its parent at most 2
        "lending_limit_gpus": 2.0,
        "borrowing_limit_gpus": None,
        "ceiling_gpus": None,
        "held_gpus": 11.0,
        "used_gpus": 10.0,  # the lab's 8 and nlp's 2
        "borrowed_gpus": 0.0,  # it draws 1 on the root's pool, which it lends 2
        "weight": 1.0,
        "cohorts": ["vision-lab"],
        "teams": ["nlp"],
    }
    # The teams' own rows name the same tree.
    rows = {t.team: t for t in models.Teams.model_validate(get(client, f"{API}/teams")).teams}
    assert rows["speech"].cohorts == ["vision-lab", "research"] and rows["ops"].cohorts == []


def test_without_a_tree_there_are_no_cohorts(
    store: Store, history: History, client: TestClient
) -> None:
    assert get(client, f"{API}/cohorts") == {"cohorts": []}


def test_the_queue_gives_reason_position_since_when_and_eta(
    store: Store, history: History, client: TestClient
) -> None:
    queue = models.Queue.model_validate(get(client, f"{API}/queue"))
    assert [(j.id, j.team, j.position) for j in queue.jobs] == [
        (history.victim, "a", 1),
        ("e", "b", 1),  # priority 10 goes before d, queued earlier at priority 0
        ("d", "b", 2),
    ]
    victim, e, _ = queue.jobs
    assert victim.reason is not None and victim.reason.code == "quota"
    assert "team a" in (victim.reason.message or "")
    # Since it was requeued after its preemption (t=12), not since it was submitted.
    assert victim.waiting_since.timestamp() == 12.0
    assert (e.reason, e.waiting_since.timestamp(), e.priority, e.gpus) == (None, 21.0, 10, 1.0)
    assert victim.eta is None  # no estimate yet: the scheduling loop makes them

    # As the loop does: the engine run forward from the store's state (scheduling/eta.py).
    assert store.estimate_starts(now=30.0) == 3
    queue = models.Queue.model_validate(get(client, f"{API}/queue"))
    etas = {j.id: j.eta for j in queue.jobs}
    assert all(eta is not None and eta.computed_at.timestamp() == 30.0 for eta in etas.values())
    # e fits now: no job end to wait for, nothing guessed; the victim waits for running jobs
    # to end, and none has a time limit: an estimate.
    assert (etas["e"].at.timestamp(), etas["e"].basis) == (30.0, "limits")
    assert etas[history.victim].at.timestamp() > 30.0
    assert etas[history.victim].basis == "estimate"
    job = models.Job.model_validate(get(client, f"{API}/jobs/{history.victim}"))
    assert job.eta == queue.jobs[0].eta

    only_b = models.Queue.model_validate(get(client, f"{API}/queue?team=b"))
    assert [j.id for j in only_b.jobs] == ["e", "d"]
    assert "no team 'zzz'" in get(client, f"{API}/queue?team=zzz", 404)["detail"]


def test_a_job_shows_placement_attempts_outcome_and_history(
    store: Store, history: History, client: TestClient
) -> None:
    running = models.Job.model_validate(get(client, f"{API}/jobs/{history.survivor}"))
    st = store.status(history.survivor)
    assert running.state == "running" and running.attempts == 1
    assert running.placement is not None and running.placement.level == st.level
    assert [(r.node, r.gpus, r.share) for r in running.placement.replicas] == [
        (r.node, list(r.gpus), None) for r in st.placement
    ]
    assert running.started_at is not None and running.started_at.timestamp() == 2.0

    victim = models.Job.model_validate(get(client, f"{API}/jobs/{history.victim}"))
    assert (victim.state, victim.preemptions, victim.placement) == ("queued", 1, None)
    assert victim.outcome is not None and victim.outcome.outcome == "preempted"
    assert victim.position == 1 and victim.reason is not None
    assert [e.type for e in victim.events] == ["submit", "admit", "start", "preempt", "requeue"]
    assert victim.events[3].data["by"] == "b1"

    shared = models.Job.model_validate(get(client, f"{API}/jobs/c"))
    assert shared.placement is not None and shared.placement.replicas[0].share == 0.5
    done = models.Job.model_validate(get(client, f"{API}/jobs/f"))
    assert done.state == "succeeded" and done.outcome == models.Outcome(
        outcome="succeeded", exit_code=0, message=""
    )
    assert done.finished_at is not None and done.finished_at.timestamp() == 18.0

    missing = get(client, f"{API}/jobs/no-such-job", 404)
    assert "no job 'no-such-job'" in missing["detail"]


def test_the_gpu_map_shows_who_holds_every_gpu(
    store: Store, history: History, client: TestClient
) -> None:
    nodes = models.Nodes.model_validate(get(client, f"{API}/nodes")).nodes
    assert [(n.name, len(n.gpus)) for n in nodes] == [(n.name, n.gpus) for n in CLUSTER.nodes]
    drawn = {(n.name, g.index): g for n in nodes for g in n.gpus}
    # Every GPU each placed job holds in the store is drawn with that job, and no other.
    expected: dict[tuple[str, int], set[str]] = {key: set() for key in drawn}
    for s in store.jobs(states=["admitted", "running", "preempting"]):
        for r in s.placement:
            for gpu in r.gpus:
                expected[r.node, gpu].add(s.id)
    assert {k: {h.job for h in g.holders} for k, g in drawn.items()} == expected
    by_state = {g.state for g in drawn.values()}
    assert by_state == {"free", "held", "shared"}
    for g in drawn.values():
        used = sum(h.share for h in g.holders)
        assert g.free == pytest.approx(1.0 - used)
        assert g.state == ("free" if not g.holders else "shared" if used < 1 else "held")
    (shared,) = [g for g in drawn.values() if g.state == "shared"]
    assert [(h.job, h.team, h.share) for h in shared.holders] == [("c", "b", 0.5)]
    held = sum(h.share for g in drawn.values() for h in g.holders)
    assert held == sum(u.gpus for u in store.usage().values()) == 6.5


def test_a_stopping_victim_is_drawn_on_its_gpus(store: Store, client: TestClient) -> None:
    borrow(store)
    h = reclaim(store)
    nodes = models.Nodes.model_validate(get(client, f"{API}/nodes")).nodes
    states = {x.state for n in nodes for g in n.gpus for x in g.holders if x.job == h.victim}
    assert states == {"preempting"}
    # b1 was given 2 of the victim's GPUs: they count once, as stopping, until it has stopped.
    assert by_name(scrape(client), "berth_cluster_gpus") == {
        (("state", "free"),): 0.0,
        (("state", "held"),): 4.0,
        (("state", "stopping"),): 4.0,
    }


def test_cancel_ends_the_job_in_the_store(
    store: Store, history: History, client: TestClient
) -> None:
    r = client.post(f"{API}/jobs/d/cancel")
    assert r.status_code == 200, r.text
    assert models.Job.model_validate(r.json()).state == "cancelled"
    assert store.status("d").state == "cancelled"
    assert store.events("d")[-1].data["message"] == "cancelled by on-call (Berth API)"
    assert [j.id for j in models.Queue.model_validate(get(client, f"{API}/queue")).jobs] == [
        history.victim,
        "e",
    ]

    r = client.post(f"{API}/jobs/{history.survivor}/cancel")  # a running job: GPUs freed
    assert r.status_code == 200 and store.status(history.survivor).state == "cancelled"
    assert store.usage()["a"].gpus == 0.0
    assert get(client, f"{API}/teams")["teams"][0]["held_gpus"] == 0.0

    again = client.post(f"{API}/jobs/d/cancel")
    assert again.status_code == 409 and "already ended (cancelled)" in again.json()["detail"]
    ended = client.post(f"{API}/jobs/f/cancel")
    assert ended.status_code == 409 and store.status("f").state == "succeeded"
    missing = client.post(f"{API}/jobs/nope/cancel")
    assert missing.status_code == 404 and "no job 'nope'" in missing.json()["detail"]


def test_a_task_instance_finds_the_job_of_its_gpu_job_group(
    store: Store, client: TestClient
) -> None:
    """As Airflow's UI asks for the job of any task of a `gpu_job` group (the "Berth job" view
    on a task instance): by the labels the run task gave the job (operators/job.py)."""

    def submitted(job_id: str, run: str, task: str, map_index: int = -1) -> None:
        labels = {"dag_id": "train", "run_id": run, "task_id": task, "map_index": str(map_index)}
        store.submit(job_spec(job_id, "a", 1), job_id=job_id, labels=labels)

    submitted("r1", "run-1", "resnet.run")
    submitted("b1", "run-1", "bert.run")
    submitted("r2", "run-2", "resnet.run")
    submitted("m0", "run-1", "sweep.run", map_index=0)
    submitted("m1", "run-1", "sweep.run", map_index=1)
    store.submit(job_spec("cli", "a", 1), job_id="cli")  # no labels: no DAG submitted it

    def found(**query: Any) -> list[str]:
        got = models.JobRefs.model_validate(get(client, f"{API}/jobs", params=query))
        return [j.id for j in got.jobs]

    run1 = {"dag_id": "train", "run_id": "run-1"}
    assert found(**run1) == ["r1", "b1", "m0", "m1"]
    for task in ("resnet.run", "resnet.wait", "resnet.validate", "resnet.cleanup"):
        assert found(**run1, task_id=task) == ["r1"], task
    assert found(dag_id="train", run_id="run-2", task_id="resnet.stage_data") == ["r2"]
    assert found(**run1, task_id="sweep.run", map_index=1) == ["m1"]
    assert found(**run1, task_id="report") == []  # a task in no group submitted nothing
    assert found(dag_id="other", run_id="run-1") == []
    ref = models.JobRefs.model_validate(get(client, f"{API}/jobs", params=run1)).jobs[2]
    assert (ref.task_id, ref.map_index, ref.state) == ("sweep.run", 0, "queued")
    assert get(client, f"{API}/jobs", 422, params={"dag_id": "train"})  # run_id is required


def test_the_pages_are_static_files_under_a_strict_policy(client: TestClient) -> None:
    for path in ("queues", "cluster", "jobs/any-id", "task?dag_id=d&run_id=r"):
        r = client.get(f"/berth/ui/{path}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        policy = r.headers["content-security-policy"]
        assert "script-src 'self';" in policy and "frame-ancestors 'self'" in policy
        assert "<script>" not in r.text  # only script files: the policy allows no inline one
    for asset in ("berth.js", "berth.css", "queues.js", "icons/cluster.svg"):
        assert client.get(f"/berth/ui/static/{asset}").status_code == 200, asset


# -- login and layers -------------------------------------------------------------------------


def test_the_api_asks_for_an_airflow_login_and_metrics_do_not(
    store: Store, history: History
) -> None:
    client = mounted(store, login=True)
    for path in ("teams", "cohorts", "queue", "nodes", "jobs/d"):
        r = client.get(f"{API}/{path}")
        assert r.status_code == 401, (path, r.text)
    r = client.post(f"{API}/jobs/d/cancel")
    assert r.status_code == 401 and store.status("d").state == "queued"
    assert client.get("/berth/metrics").status_code == 200


def test_every_route_and_shape_is_documented(client: TestClient) -> None:
    spec = get(client, "/berth/openapi.json")
    routes = {(path, method) for path, ops in spec["paths"].items() for method in ops}
    assert routes == {
        ("/api/v1/teams", "get"),
        ("/api/v1/cohorts", "get"),
        ("/api/v1/queue", "get"),
        ("/api/v1/jobs", "get"),
        ("/api/v1/jobs/{job_id}", "get"),
        ("/api/v1/nodes", "get"),
        ("/api/v1/jobs/{job_id}/cancel", "post"),
        ("/metrics", "get"),
    }
    ok = {path: ops[next(iter(ops))]["responses"] for path, ops in spec["paths"].items()}
    assert ok["/api/v1/jobs/{job_id}/cancel"].keys() >= {"200", "404", "409"}
    schema = ok["/api/v1/teams"]["200"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/Teams"}
    assert {"Teams", "Cohorts", "Queue", "QueuedJob", "Job", "Nodes", "Gpu"} <= spec["components"][
        "schemas"
    ].keys()


def test_airflow_loads_only_the_registration_and_it_builds_nothing() -> None:
    """Airflow imports each `.py` of its plugins folder as a top-level module named after the
    file (`models.py` would become `sys.modules["models"]`), in every process, tasks too."""
    seen = find_path_from_directory(REPO / "plugins", ".airflowignore", "glob")
    assert [Path(p).relative_to(REPO / "plugins").as_posix() for p in seen] == ["berth_plugin.py"]
    probe = (
        "import sys, plugins.berth_plugin as p; "
        "print(sorted(m for m in ('fastapi', 'plugins.berth_api') if m in sys.modules)); "
        "p.BerthPlugin().fastapi_apps; "
        "print(sorted(m for m in ('fastapi', 'plugins.berth_api') if m in sys.modules))"
    )
    env = {**os.environ, "BERTH_POOL_SYNC_S": "0"}  # no Airflow database here to sync into
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = [ln for ln in done.stdout.splitlines() if ln.startswith("[")]  # not Airflow's log
    assert printed == ["[]", "['fastapi', 'plugins.berth_api']"]
