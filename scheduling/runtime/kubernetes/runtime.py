"""The Kubernetes runtime: an admitted gang as pods, exactly where the engine placed it.

One attempt is a headless Service (rank 0's DNS name, the owner of the pods, and the launch
record in an annotation) and one pod per replica bound to its node (see `pods.py`). Nothing
is kept locally: any process finds an attempt again by its labels (`reattach`), and what a
poller decides (the gang's failure, a stop) is written on the Service, so that every later
poll, from any process, tells the same story.

All or nothing at run time, as Kueue's waitForPodsReady: `poll` tears the attempt down when
not every replica is Running `start_timeout_s` after launch, and when any replica fails; the
status says which replica failed, why, and whether to fail, retry or requeue (`status.py`).
`poll` enforces these, so the caller polls (the completion trigger does); the kubelet enforces
the time limit by itself (`activeDeadlineSeconds`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from scheduling.cluster import Cluster
from scheduling.jobs import Placement
from scheduling.runtime.base import Launch, LaunchError, LogCursor, check_launch
from scheduling.runtime.kubernetes import pods as manifests
from scheduling.runtime.kubernetes import status as fate
from scheduling.runtime.kubernetes.inventory import BERTH, MANAGED_BY
from scheduling.runtime.kubernetes.pods import FAILURE, JOB_ID, LAUNCH, STOPPED, KubeLaunch
from scheduling.runtime.kubernetes.status import KubeGangStatus, api_problem, failure_record
from scheduling.spec import JobSpec

LOG_CHUNK = 1 << 20  # bytes of rank 0's log per `logs` call
MERGE_PATCH = "application/merge-patch+json"


class LogsUnavailable(RuntimeError):
    """The API server could not serve a pod's log; the message says which pod and what to
    check. Raised rather than returning nothing, so that a missing log is never silent."""


class KubernetesRuntime:
    """Runs gangs as pods in each team's namespace; see the module docstring."""

    def __init__(
        self,
        api: client.ApiClient,
        settings: manifests.KubeSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.settings = settings or manifests.KubeSettings()
        self.clock = clock  # wall clock, as Launch.launched_at

    def namespace(self, team: str) -> str:
        """The team's namespace (LaunchError naming the setting when it is not valid)."""
        try:
            return manifests.namespace_for(self.settings, team)
        except ValueError as e:
            raise LaunchError(str(e)) from None

    # ---- launch -------------------------------------------------------------------------

    def launch(
        self,
        job_id: str,
        attempt: int,
        command: Sequence[str],
        placement: Placement,
        cluster: Cluster,
        *,
        env: Mapping[str, str],
        workdir: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
        time_limit_s: float | None = None,
        image: str | None = None,
        team: str | None = None,
        cpus: float = 1.0,
        memory_gb: float = 4.0,
    ) -> KubeLaunch:
        """Create the attempt's Service, then one pod per replica on its node; returns at once
        (`poll` watches the start). `workdir` is ignored: the image's working directory holds.

        Raises LaunchError for bad input, an attempt launched before, or a refused object (what
        was created is deleted first: no partial gangs).
        """
        check_launch(job_id, attempt, command, placement, cluster, env, extra_env, time_limit_s)
        if not image:
            raise LaunchError("image: the Kubernetes runtime runs a container image; set `image`")
        if not team:
            raise LaunchError("team: required, it picks the namespace; pass the job's team")
        if not (cpus > 0 and memory_gb > 0):
            raise LaunchError(f"cpus, memory_gb: must be > 0, got {cpus}, {memory_gb}")
        namespace = self.namespace(team)
        launch = manifests.new_launch(
            self.settings, job_id, attempt, placement, cluster, namespace=namespace,
            team=team, image=image, launched_at=self.clock(), time_limit_s=time_limit_s,
        )  # fmt: skip
        service = launch.service
        try:
            owner = self.core.create_namespaced_service(
                namespace, manifests.service_manifest(launch)
            )
        except ApiException as e:
            if e.status == 409:
                raise LaunchError(
                    f"job {job_id!r} attempt {attempt} was launched before (Service "
                    f"{namespace}/{service}); reattach(job_id, attempt) to follow it, or launch "
                    "a new attempt number"
                ) from None
            raise LaunchError(f"the attempt's Service was refused: {api_problem(e)}") from None
        cpu, mem = manifests.engine_units(cpus, memory_gb)
        variables = dict(env) | dict(extra_env or {})
        for rep in launch.replicas:
            body = manifests.pod_manifest(
                self.settings, launch, rep, list(command), variables, cpu, mem, owner.metadata.uid
            )
            try:
                self.core.create_namespaced_pod(namespace, body)
            except ApiException as e:
                self._delete(launch, 0, service=True)
                why = api_problem(e)
                raise LaunchError(
                    f"rank {rep.rank}'s pod was refused, so the attempt was deleted: {why}"
                ) from None
        return launch

    def launch_spec(
        self,
        spec: JobSpec,
        job_id: str,
        attempt: int,
        placement: Placement,
        cluster: Cluster,
        *,
        extra_env: Mapping[str, str] | None = None,
    ) -> KubeLaunch:
        """`launch` with what a JobSpec says (image, team, command, resources, env, limit)."""
        if spec.image is None:
            raise LaunchError(
                "image: the Kubernetes runtime runs container images; build the job's "
                "`environment` into an image and set `image` instead"
            )
        return self.launch(
            job_id, attempt, spec.command, placement, cluster,
            env=spec.env, extra_env=extra_env, time_limit_s=spec.time_limit_s,
            image=spec.image, team=spec.team,
            cpus=spec.cpus_per_replica, memory_gb=spec.memory_gb_per_replica,
        )  # fmt: skip

    # ---- follow -------------------------------------------------------------------------

    def poll(self, launch: Launch) -> KubeGangStatus:
        """The gang now. On its first failure (or a start timeout, or the time limit) the
        failure is written on the Service and every replica still running is deleted with the
        grace period before this returns."""
        launch = _kube(launch)
        owner, by_rank = self._service(launch), self._pods(launch)
        common = {"started_at": launch.launched_at, "time_limit_s": launch.time_limit_s}
        notes = (owner and owner.metadata.annotations) or {}
        if owner is None or STOPPED in notes or FAILURE in notes:
            if any(p.metadata.deletion_timestamp is None and _running(p) for p in by_rank.values()):
                self._delete(launch, self.settings.grace_s, by_rank=by_rank, only_running=True)
                by_rank = self._pods(launch)
            replicas = _statuses(launch, by_rank, ending=True)
            if FAILURE in notes:
                record = json.loads(notes[FAILURE])
                return KubeGangStatus(state="failed", replicas=replicas, **common, **record)
            told = "stopped on request" if owner else "stopped: its Service is gone"
            return KubeGangStatus(state="stopped", replicas=replicas, **common, message=told)
        alive = self._nodes_alive(launch, by_rank)
        failures = fate.gang_failures(launch, by_rank, alive, self.clock())
        if failures:
            record = self._record_failure(launch, owner, failure_record(failures))
            self._delete(launch, self.settings.grace_s, by_rank=by_rank, only_running=True)
            by_rank = self._pods(launch)
            replicas = _statuses(launch, by_rank, ending=True)
            return KubeGangStatus(state="failed", replicas=replicas, **common, **record)
        replicas = _statuses(launch, by_rank, ending=False)
        done = all(s.state == "exited" and s.exit_code == 0 for s in replicas)
        return KubeGangStatus(state="succeeded" if done else "running", replicas=replicas, **common)

    def stop(self, launch: Launch, grace_s: float | None = None) -> None:
        """Delete the attempt's pods with a grace period (SIGTERM, then SIGKILL after
        `grace_s`, default the settings': time to checkpoint), then its Service. Idempotent."""
        launch = _kube(launch)
        grace = self.settings.grace_s if grace_s is None else grace_s
        body = {"metadata": {"annotations": {STOPPED: str(self.clock())}}}
        try:
            self.core.patch_namespaced_service(
                launch.service, launch.namespace, body, _content_type=MERGE_PATCH
            )
        except ApiException as e:
            if e.status != 404:
                raise
        self._delete(launch, grace, service=True)

    def logs(self, launch: Launch, cursor: LogCursor | None = None) -> tuple[list[str], LogCursor]:
        """Complete new lines of rank 0's log since `cursor`, as `[rank 0] line`.

        The API server reads logs from the node's kubelet; when it cannot, LogsUnavailable says
        which pod and what to check (never an empty answer that looks like a quiet job)."""
        launch = _kube(launch)
        rep = launch.replicas[0]
        offset = (cursor.offsets if cursor else {}).get(0, 0)
        pod = self._pods(launch).get(0)
        if pod is None or pod.status.phase == "Pending":
            return [], cursor or LogCursor()
        try:
            response = self.core.read_namespaced_pod_log(
                rep.pod, launch.namespace, container=manifests.CONTAINER,
                limit_bytes=offset + LOG_CHUNK, _preload_content=False, _request_timeout=30,
            )  # fmt: skip
            data = response.data[offset:]
        except ApiException as e:
            raise LogsUnavailable(
                f"the log of rank 0 (pod {launch.namespace}/{rep.pod} on node {rep.node_name}) "
                f"cannot be read through the API server: {api_problem(e)}; the API server reads "
                "logs from the node's kubelet, so check that it reaches the node on the "
                "kubelet's port (kubectl logs shows the same)"
            ) from None
        ended = pod.status.phase in ("Succeeded", "Failed")
        cut = len(data) if ended and len(data) < LOG_CHUNK else data.rfind(b"\n") + 1
        if len(data) == LOG_CHUNK and cut == 0:
            cut = len(data)  # one huge line: in pieces
        lines = data[:cut].decode("utf-8", errors="replace").splitlines()
        return [f"[rank 0] {line}" for line in lines], LogCursor(offsets={0: offset + cut})

    def reattach(self, job_id: str, attempt: int, *, team: str | None = None) -> KubeLaunch | None:
        """The handle of a launched attempt from its Service's record; None if none. Without
        `team` the namespace is found from the attempt's pods (cluster-wide, by label)."""
        if team is not None:
            namespaces = [self.namespace(team)]
        else:
            found = self.core.list_pod_for_all_namespaces(
                label_selector=manifests.selector(job_id, attempt)
            )
            namespaces = sorted({p.metadata.namespace for p in found.items})
        for namespace in namespaces:
            try:
                owner = self.core.read_namespaced_service(
                    manifests.attempt_name(job_id, attempt), namespace
                )
            except ApiException as e:
                if e.status == 404:
                    continue
                raise
            notes = owner.metadata.annotations or {}
            if notes.get(JOB_ID) == job_id and LAUNCH in notes:
                return KubeLaunch.from_dict(json.loads(notes[LAUNCH]))
        return None

    def launch_from_dict(self, data: Mapping[str, Any]) -> KubeLaunch:
        return KubeLaunch.from_dict(data)

    def cleanup_orphans(
        self, known_live: set[tuple[str, int]], namespaces: Iterable[str] | None = None
    ) -> list[str]:
        """Delete Berth's pods and Services of attempts not in `known_live` ((job id, attempt)
        pairs the store considers live) in `namespaces` (the teams'); returns
        'namespace/kind/name' of each deleted.

        None: every namespace where Berth's pods are found (cluster-wide); a Service whose pods
        are all gone is then missed, so pass the teams' namespaces when they are known."""
        berth = f"{MANAGED_BY}={BERTH},{manifests.JOB},{manifests.ATTEMPT}"
        found = self.core.list_pod_for_all_namespaces(label_selector=berth).items
        scope = {p.metadata.namespace for p in found} if namespaces is None else set(namespaces)
        deleted: list[str] = []
        for pod in found:
            ns, name = pod.metadata.namespace, pod.metadata.name
            if ns in scope and manifests.attempt_key(pod) not in known_live:
                self._delete_one("pod", ns, name, self.settings.grace_s)
                deleted.append(f"{ns}/pod/{name}")
        for ns in sorted(scope):
            for svc in self.core.list_namespaced_service(ns, label_selector=berth).items:
                if manifests.attempt_key(svc) not in known_live:
                    self._delete_one("service", ns, svc.metadata.name)
                    deleted.append(f"{ns}/service/{svc.metadata.name}")
        return deleted

    # ---- helpers ------------------------------------------------------------------------

    def _service(self, launch: KubeLaunch) -> Any | None:
        try:
            return self.core.read_namespaced_service(launch.service, launch.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _pods(self, launch: KubeLaunch) -> dict[int, Any]:
        """This attempt's pods by rank (those of a same-named attempt of another id excluded)."""
        found = self.core.list_namespaced_pod(
            launch.namespace, label_selector=manifests.selector(launch.job_id, launch.attempt)
        )
        names = {r.pod: r.rank for r in launch.replicas}
        return {names[p.metadata.name]: p for p in found.items if p.metadata.name in names}

    def _nodes_alive(self, launch: KubeLaunch, by_rank: Mapping[int, Any]) -> dict[str, bool]:
        """Whether each node of the gang still exists (asked only where a pod may need it)."""
        alive = {r.node_name: True for r in launch.replicas}
        for rep in launch.replicas:
            pod = by_rank.get(rep.rank)
            if pod is None or pod.status.phase in ("Pending", "Running"):
                try:
                    self.core.read_node(rep.node_name)
                except ApiException as e:
                    if e.status != 404:
                        raise
                    alive[rep.node_name] = False
        return alive

    def _record_failure(
        self, launch: KubeLaunch, owner: Any, record: dict[str, Any]
    ) -> dict[str, Any]:
        """Write the failure on the Service unless another poller wrote one first (the
        resourceVersion precondition); returns the one that stands."""
        meta = {"resourceVersion": owner.metadata.resource_version}
        body = {"metadata": meta | {"annotations": {FAILURE: json.dumps(record)}}}
        try:
            self.core.patch_namespaced_service(
                launch.service, launch.namespace, body, _content_type=MERGE_PATCH
            )
        except ApiException as e:
            if e.status not in (404, 409):
                raise
            again = self._service(launch)
            notes = (again and again.metadata.annotations) or {}
            if FAILURE in notes:
                return json.loads(notes[FAILURE])
        return record

    def _delete(
        self,
        launch: KubeLaunch,
        grace_s: float,
        *,
        by_rank: Mapping[int, Any] | None = None,
        only_running: bool = False,
        service: bool = False,
    ) -> None:
        """Delete the attempt's pods (only those not yet ended, when `only_running`: a failed
        pod keeps its status for people to read), then its Service when `service`."""
        for rep in launch.replicas:
            pod = by_rank.get(rep.rank) if by_rank is not None else None
            if by_rank is not None and pod is None:
                continue
            if only_running and pod is not None and not _running(pod):
                continue
            self._delete_one("pod", launch.namespace, rep.pod, grace_s)
        if service:
            self._delete_one("service", launch.namespace, launch.service)

    def _delete_one(self, kind: str, namespace: str, name: str, grace_s: float = 0) -> None:
        call = {
            "pod": self.core.delete_namespaced_pod,
            "service": self.core.delete_namespaced_service,
        }[kind]
        try:
            call(name, namespace, grace_period_seconds=round(grace_s))
        except ApiException as e:
            if e.status != 404:
                raise


def _kube(launch: Launch) -> KubeLaunch:
    if not isinstance(launch, KubeLaunch):
        raise LaunchError(
            f"launch: a {launch.runtime!r} launch cannot be followed by the Kubernetes "
            "runtime; use the runtime that launched it (or launch_from_dict)"
        )
    return launch


def _statuses(
    launch: KubeLaunch, by_rank: Mapping[int, Any], *, ending: bool
) -> tuple[fate.KubeReplicaStatus, ...]:
    return tuple(fate.replica_status(r, by_rank.get(r.rank), ending) for r in launch.replicas)


def _running(pod: Any) -> bool:
    return pod.status.phase in ("Pending", "Running")
