"""Berth's gangs on nodes whose kubelet is KWOK (tests/kwok.py), not this process: pods start,
run and end on their own time, and the runtime, reading its watch, follows them to the end; a
replica that fails ends its gang with its code; Berth's teardown leaves nothing behind. And
faults with the store in the loop: pods killed mid-run, the API server restarted mid-run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_gang import ensure_priority_class
from kubeapi import REPO, KubeAPI, kube_api, run_kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import make_node
from kubernetes import client
from kwok import EXIT_CODE, FAKE, kwok_path, run_kwok
from store_workload import audit
from waiting import wait_for

from berth.runtime import RuntimeUnavailable
from berth.runtime.kubernetes import KubernetesRuntime, KubeSettings, discover_cluster
from berth.runtime.kubernetes.live import LiveCluster
from berth.runtime.kubernetes.pods import KubeLaunch
from berth.runtime.kubernetes.watch import ClusterWatch
from berth.spec import parse_spec
from berth.store import Store
from scheduling.config import parse_teams
from scheduling.jobs import Placement, ReplicaPlacement
from scheduling.quota import Team


class KwokGang:
    """KWOK nodes of 8 GPUs (two unless told) in a pool of their own, a team namespace, and a
    runtime that reads a watch."""

    def __init__(self, kube: KubeAPI, watch: ClusterWatch, nodes: int = 2) -> None:
        self.kube, self.core = kube, kube.core
        pool = self.pool = kube.unique_name("kwok")
        self.nodes = [f"{pool}-{chr(ord('a') + i)}" for i in range(nodes)]
        for name in self.nodes:
            make_node(self.core, name, labels={"berth.io/pool": pool}, annotations={FAKE: "fake"})
        self.team = kube.unique_name("team")
        self.ns = f"berth-{self.team}"
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.ns)))
        kube.create_service_account(self.ns, "default")
        self.cluster = discover_cluster(self.core, node_selector=f"berth.io/pool={pool}").cluster
        settings = KubeSettings(start_timeout_s=60, grace_s=0)
        self.runtime = KubernetesRuntime(kube.admin, settings, watch=watch)

    def launch(self, job_id: str) -> KubeLaunch:
        placement = Placement(
            (ReplicaPlacement(0, (0, 1, 2, 3)), ReplicaPlacement(1, (4, 5, 6, 7))), "rack"
        )
        return self.runtime.launch(
            job_id, 1, ["python", "train.py"], placement, self.cluster,
            env={}, image="ghcr.io/org/train:1.0", team=self.team, cpus=8, memory_gb=32,
        )  # fmt: skip

    def pods(self) -> list[Any]:
        return self.core.list_namespaced_pod(self.ns).items

    def teams(self) -> dict[str, Team]:
        return parse_teams(
            {"teams": [{"name": self.team, "nominal": {"gpus": 8 * len(self.nodes)}}]}
        )


def submit_jobs(store: Store, g: KwokGang, count: int) -> None:
    """`count` jobs f0, f1, ...: every fourth a gang of 2 x 4 GPUs, the others 2 GPUs."""
    for i in range(count):
        gang = i % 4 == 0
        spec = {
            "name": f"f{i}", "team": g.team, "image": "ghcr.io/org/train:1.0",
            "command": ["python", "train.py"], "replicas": 2 if gang else 1,
            "gpus_per_replica": 4 if gang else 2, "cpus_per_replica": 2, "memory_gb_per_replica": 8,
        }  # fmt: skip
        store.submit(parse_spec(spec), job_id=f"f{i}")


Fault = Callable[[dict[str, tuple[int, KubeLaunch]]], None]


def drive(
    store: Store,
    g: KwokGang,
    *,
    fault_after: int,
    fault: Fault,
    timeout_s: float = 180,
    live: LiveCluster | None = None,
) -> dict[str, Any]:
    """Run the store's jobs to their ends as the run and completion tasks would: launch what a
    cycle admits (a launch the runtime cannot make for now ends as lost), poll each gang (one
    it cannot tell about for now is asked again), end it in the store as it ended (a requeue as
    lost). `fault(live launches)` runs once `fault_after` gangs have been launched. With
    `live` (the store's cluster source), placements are read against the cluster as it is
    now, as the run task reads them."""
    total = len(store.jobs())
    launches: dict[str, tuple[int, KubeLaunch]] = {}
    out: dict[str, Any] = {"succeeded": [], "lost": [], "interrupted": [], "unknown": 0}
    to_stop: list[KubeLaunch] = []
    launched, faulted = 0, False
    deadline = time.monotonic() + timeout_s
    while len(out["succeeded"]) < total:
        assert time.monotonic() < deadline, f"not every job ended in {timeout_s} s: {out}"
        for job_id in store.schedule().admitted:
            st = store.status(job_id)
            cluster = live().cluster if live is not None else g.cluster
            placement = Placement(
                tuple(
                    ReplicaPlacement(cluster.by_name[r.node].index, r.gpus, r.share)
                    for r in st.placement
                ),
                st.level or "cluster",
            )
            try:
                launch = g.runtime.launch_spec(st.spec, job_id, st.attempt, placement, cluster)
            except RuntimeUnavailable as e:
                store.finish(job_id, "lost", message=str(e), attempt=st.attempt)
                out["interrupted"].append(job_id)
                continue
            launches[job_id] = (st.attempt, launch)
            store.mark_started(job_id, st.attempt)
            launched += 1
        if not faulted and launched >= fault_after:
            fault(launches)
            faulted = True
        for job_id, (attempt, launch) in list(launches.items()):
            try:
                gang = g.runtime.poll(launch)
            except RuntimeUnavailable:
                out["unknown"] += 1
                continue
            if gang.state == "running":
                continue
            if gang.state == "succeeded":
                store.finish(job_id, "succeeded", exit_code=0, attempt=attempt)
                out["succeeded"].append(job_id)
            elif gang.disposition == "requeue":
                store.finish(job_id, "lost", message=gang.message or "", attempt=attempt)
                out["lost"].append(job_id)
                out.setdefault("why", {})[job_id] = gang.message
            else:
                raise AssertionError(f"{job_id}: {gang.state} {gang.message}")
            del launches[job_id]
            to_stop.append(launch)
        for launch in list(to_stop):  # its Service (and what is left); again if it cannot
            with contextlib.suppress(RuntimeUnavailable):
                g.runtime.stop(launch)
                to_stop.remove(launch)
        time.sleep(0.2)
    for launch in to_stop:
        g.runtime.stop(launch)
    out["usage"] = sum(u.gpus for u in store.usage().values())
    # The store's history replayed (tests/store_workload.py): no GPU given twice or used by
    # two running jobs, the team's quota held, each attempt admitted once.
    out["audit"] = dict(audit(store.events(), {g.team: 8 * len(g.nodes)}))
    return out


@pytest.fixture
def gang(kube_api: KubeAPI, tmp_path: Path) -> Iterator[KwokGang]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    watch = ClusterWatch(kube_api.admin, timeout_s=5, stale_s=20)
    watch.start()
    assert watch.wait_synced(30)
    with run_kwok(kube_api, tmp_path / "kwok", run_ms=1500, jitter_ms=1500):
        yield KwokGang(kube_api, watch)
    watch.stop()


def test_a_gang_runs_and_ends_on_kwok_nodes(gang: KwokGang) -> None:
    launch = gang.launch("kwok-ok")
    seen: list[str] = []

    def ended() -> bool:
        status = gang.runtime.poll(launch)
        seen.append(f"{status.state} {status.message or ''}".strip())
        return status.state != "running"

    wait_for(ended, "the gang to end on its own", timeout=60, every=0.2)
    assert seen[-1] == "succeeded", seen[-1]
    assert "running" in seen  # it ran first: KWOK's pods take 1.5 to 3 s
    assert all(p.status.phase == "Succeeded" for p in gang.pods())
    gang.runtime.stop(launch)
    wait_for(lambda: gang.pods() == [], "KWOK to delete the stopped attempt's pods")


def test_a_failed_replica_ends_its_gang_with_its_code(gang: KwokGang) -> None:
    launch = gang.launch("kwok-fail")
    rank1 = launch.replicas[1].pod
    body = {"metadata": {"annotations": {EXIT_CODE: "7"}}}
    gang.core.patch_namespaced_pod(rank1, gang.ns, body)  # before KWOK's delay runs out
    status = wait_for(
        lambda: (s := gang.runtime.poll(launch)).state != "running" and s,
        "the gang to fail",
        timeout=60,
        every=0.2,
    )
    assert status.state == "failed" and status.failed_rank == 1 and status.exit_code == 7
    gang.runtime.stop(launch)
    wait_for(lambda: gang.pods() == [], "KWOK to delete the failed attempt's pods")


def test_the_build_script_and_the_harness_agree_on_where_kwok_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("BERTH_KWOK_CACHE", str(cache))
    script = str(REPO / "scripts/build-kwok.sh")
    where = subprocess.run([script, "--where"], capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()) == kwok_path()
    assert kwok_path().parent.name.startswith("v0.") and not cache.exists()  # builds nothing


def test_pods_killed_mid_run_lose_no_job_and_leak_nothing(
    kube_api: KubeAPI,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The store, the runtime (through its watch) and KWOK's kubelets, as the completion
    triggers drive them: 24 jobs (some 2-replica gangs) on 4 nodes; once 8 gangs are launched,
    someone deletes one pod of each of 3 of them. Those gangs end as lost (a pod deleted by someone
    else: requeued, no retry used) and run again as a new attempt; every job succeeds in the
    end, each gang's pods and Service are gone, and the store holds no GPU."""
    ensure_priority_class(kube_api.admin)
    watch = ClusterWatch(kube_api.admin, timeout_s=5, stale_s=20)
    watch.start()
    assert watch.wait_synced(30)
    try:
        with run_kwok(kube_api, tmp_path / "kwok", run_ms=1500, jitter_ms=1500):
            g = KwokGang(kube_api, watch, nodes=4)
            store = Store(f"sqlite:///{tmp_path}/berth.db", g.cluster, g.teams())
            submit_jobs(store, g, 24)
            outcomes = drive(store, g, fault_after=8, fault=kill_one_pod_of_three(g))
            store.close()
    finally:
        watch.stop()
    assert sorted(outcomes["succeeded"]) == sorted(f"f{i}" for i in range(24))
    assert len(outcomes["lost"]) == 3, outcomes["lost"]  # the killed gangs, once each
    assert outcomes["audit"]["lost"] == 3 and outcomes["audit"]["admit"] == 27, outcomes["audit"]
    print(f"audit of the store's history: {outcomes['audit']}")
    assert outcomes["usage"] == 0
    assert g.core.list_namespaced_service(g.ns).items == []
    wait_for(lambda: g.pods() == [], "KWOK to delete the last pods Berth deleted")


def kill_one_pod_of_three(g: KwokGang) -> Fault:
    def kill(launches: dict[str, tuple[int, KubeLaunch]]) -> None:
        for _, launch in sorted(launches.values(), key=lambda a: a[1].job_id)[:3]:
            g.core.delete_namespaced_pod(launch.replicas[0].pod, g.ns, grace_period_seconds=0)

    return kill


def test_an_api_server_restart_mid_run_loses_no_job_and_leaks_nothing(tmp_path: Path) -> None:
    """The same jobs, and once 8 gangs are launched the API server goes away for 3 s and comes
    back (a crash or an upgrade). Polls meanwhile answer from the watch or say they cannot tell
    (RuntimeUnavailable), launches that cannot be made end as lost (no retry used); the watch
    lists again; every job succeeds in the end, the store holds no GPU, and what an interrupted
    launch may have left is found and deleted by the orphan cleanup."""
    (tmp_path / "api").mkdir()
    with run_kube_api(tmp_path / "api") as kube:
        ensure_priority_class(kube.admin)
        watch = ClusterWatch(kube.admin, timeout_s=5, stale_s=20, max_pause_s=1.0)
        watch.start()
        assert watch.wait_synced(30)
        restart = threading.Thread(target=kube.restart_server, args=(3.0,))
        try:
            with run_kwok(kube, tmp_path / "kwok", run_ms=1500, jitter_ms=1500):
                g = KwokGang(kube, watch, nodes=4)
                store = Store(f"sqlite:///{tmp_path}/berth.db", g.cluster, g.teams())
                submit_jobs(store, g, 24)
                outcomes = drive(store, g, fault_after=8, fault=lambda _: restart.start())
                restart.join()
                store.close()
                leftovers = g.runtime.cleanup_orphans(set(), [g.ns])
                wait_for(lambda: g.pods() == [], "KWOK to delete every pod")
        finally:
            watch.stop()
        assert sorted(outcomes["succeeded"]) == sorted(f"f{i}" for i in range(24)), outcomes
        assert outcomes["usage"] == 0
        assert kube.core.list_namespaced_service(g.ns).items == []
        assert watch.pods.lists >= 2, "the watch never listed again after the restart"
        lost = len(outcomes["interrupted"]) + len(outcomes["lost"])
        assert outcomes["audit"]["admit"] == 24 + lost, outcomes  # each requeue admitted again
        print(f"audit of the store's history: {outcomes['audit']}")
        print(f"outcomes: {outcomes}; orphans deleted: {leftovers}")


def test_a_node_removed_mid_run_loses_no_job_and_leaks_nothing(
    kube_api: KubeAPI,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The same jobs on a store whose cluster is discovered (`LiveCluster`), and once 8 gangs
    are launched a node is deleted (scaled down, or its VM gone). The gangs with a replica
    there end as lost (requeued, no retry used), the store stops placing anything on it, and
    they run again on the other three; every job succeeds, the store holds no GPU, and the
    pods left bound to the gone node are deleted with their attempts."""
    ensure_priority_class(kube_api.admin)
    watch = ClusterWatch(kube_api.admin, timeout_s=5, stale_s=20)
    watch.start()
    assert watch.wait_synced(30)
    gone: list[str] = []
    try:
        with run_kwok(kube_api, tmp_path / "kwok", run_ms=1500, jitter_ms=1500):
            g = KwokGang(kube_api, watch, nodes=4)
            live = LiveCluster(kube_api.admin, node_selector=f"berth.io/pool={g.pool}", ttl_s=0)
            store = Store(f"sqlite:///{tmp_path}/berth.db", None, g.teams(), live=live)
            submit_jobs(store, g, 24)

            def remove_a_busy_node(launches: dict[str, tuple[int, KubeLaunch]]) -> None:
                busy = sorted(r.node_name for _, la in launches.values() for r in la.replicas)
                gone.append(busy[0])
                g.core.delete_node(busy[0])

            outcomes = drive(store, g, fault_after=8, fault=remove_a_busy_node, live=live)
            placed_after = [
                r.node for j in store.jobs() for r in store.status(j.id).placement
            ]  # fmt: skip
            store.close()
            wait_for(lambda: g.pods() == [], "every pod deleted, those on the gone node too")
    finally:
        watch.stop()
    assert sorted(outcomes["succeeded"]) == sorted(f"f{i}" for i in range(24)), outcomes
    assert outcomes["lost"], "no gang had a replica on the removed node"
    assert all("lost its node" in why for why in outcomes["why"].values()), outcomes["why"]
    assert gone[0] not in placed_after  # each job's last placement avoids the gone node
    assert outcomes["usage"] == 0
    assert g.core.list_namespaced_service(g.ns).items == []
    print(f"node {gone[0]} removed; gangs lost there and run again: {sorted(outcomes['lost'])}")
    print(f"audit of the store's history: {outcomes['audit']}")


@pytest.mark.parametrize("dies_after", ["service", "pod"])
def test_a_launcher_killed_mid_launch_leaves_nothing_and_the_next_one_runs_the_job(
    kube_api: KubeAPI,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dies_after: str,
) -> None:
    """Two launchers on one store, as two triggerers would be: the first (another process,
    tests/dying_launcher.py) is SIGKILLed mid-launch of a 2 x 4-GPU gang, right after its
    Service or its first pod was created; the second runs the same trigger code
    (`launch_attempt`) for the same admitted attempt, as the triggerer that takes the trigger
    over does. It waits until the dead launcher's claim lapses, finds what the first left (by
    the team's namespace: an attempt with a Service and no pod has nothing else to find it
    by), stops it and ends the attempt as lost (requeued, no retry used); the next attempt
    launches, runs on KWOK and succeeds. Nothing is left and no GPU is held. Before the
    launcher passed the team, a Service with no pod was not found, the relaunch collided
    with it and the job failed."""
    from berth.settings import settings
    from operators.launching import LaunchBusy, LaunchInterrupted, LaunchPlan, launch_attempt
    from operators.tracking import TaskRef

    ensure_priority_class(kube_api.admin)
    with run_kwok(kube_api, tmp_path / "kwok", run_ms=1500, jitter_ms=1500):
        watch = ClusterWatch(kube_api.admin, timeout_s=5, stale_s=20)  # the fixture's shape
        g = KwokGang(kube_api, watch)
        teams = tmp_path / "teams.yaml"
        teams.write_text(f"teams:\n  - name: {g.team}\n    nominal: {{gpus: 16}}\n")
        kube_yaml = tmp_path / "kube.yaml"
        kube_yaml.write_text(
            f"node_selector: berth.io/pool={g.pool}\npods: {{grace_s: 0, start_timeout_s: 60}}\n"
        )
        env = {
            "BERTH_HOME": str(tmp_path / "berth"),
            "BERTH_RUNTIME": "kubernetes",
            "BERTH_TEAMS": str(teams),
            "BERTH_KUBE_SETTINGS": str(kube_yaml),
            "KUBECONFIG": str(kube_api.write_kubeconfig(tmp_path / "kubeconfig")),
            "BERTH_LAUNCH_LEASE_S": "3",  # 60 s by default: how long a dead launcher holds on
        }
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for name in ("BERTH_STORE_URL", "BERTH_CLUSTER", "MLFLOW_TRACKING_URI"):
            monkeypatch.delenv(name, raising=False)
        store = settings().store()
        spec = {
            "name": "dies", "team": g.team, "image": "ghcr.io/org/train:1.0",
            "command": ["python", "train.py"], "replicas": 2, "gpus_per_replica": 4,
            "cpus_per_replica": 2, "memory_gb_per_replica": 8,
        }  # fmt: skip
        store.submit(parse_spec(spec), job_id="dies")
        first = subprocess.run(
            [sys.executable, str(REPO / "tests" / "dying_launcher.py"), "dies", dies_after],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
        left = g.pods()
        assert len(left) == (0 if dies_after == "service" else 1), [p.metadata.name for p in left]
        assert len(g.core.list_namespaced_service(g.ns).items) == 1
        st = store.status("dies")
        assert (st.state, st.attempt) == ("admitted", 1)  # the store still thinks it launches

        plan = LaunchPlan(st.spec.model_dump(mode="json"), {}, TaskRef("d", "r", "t", 1))
        # The second launcher takes the trigger over: it waits while the dead one's claim is
        # fresh (as its trigger would, looking again every poll), then cleans up and requeues.
        with pytest.raises(LaunchBusy, match="is launching it"):
            launch_attempt(plan, "dies", 1)

        def take_over() -> LaunchInterrupted | None:
            try:
                launch_attempt(plan, "dies", 1)
            except LaunchBusy:
                return None
            except LaunchInterrupted as e:
                return e
            raise AssertionError("attempt 1 was adopted: its gang never ran whole")

        interrupted = wait_for(take_over, "the dead launcher's claim to lapse", 30, every=0.2)
        assert "died mid-launch" in str(interrupted)
        assert store.status("dies").state == "queued"
        assert g.core.list_namespaced_service(g.ns).items == []  # what it left is deleted
        store.schedule()
        st = store.status("dies")
        assert (st.state, st.attempt) == ("admitted", 2)
        runtime = settings().runtime()
        launch = runtime.launch_from_dict(launch_attempt(plan, "dies", 2).launch)
        ended = wait_for(
            lambda: (s := runtime.poll(launch)).state != "running" and s, "attempt 2 to end", 60
        )
        assert ended.state == "succeeded", ended
        store.finish("dies", "succeeded", exit_code=0, attempt=2)
        runtime.stop(launch)
        wait_for(lambda: g.pods() == [], "KWOK to delete attempt 2's pods")
    ends = [
        (e.data["attempt"], e.data["outcome"], e.data["message"])
        for e in store.events("dies")
        if e.type in ("lost", "finish", "fail")
    ]
    assert ends == [(1, "lost", "the launcher died mid-launch"), (2, "succeeded", "")], ends
    assert sum(u.gpus for u in store.usage().values()) == 0
    assert g.core.list_namespaced_service(g.ns).items == []
