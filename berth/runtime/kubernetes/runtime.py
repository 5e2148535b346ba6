"""The Kubernetes runtime: an admitted gang as pods, exactly where the engine placed it.

One attempt is a headless Service (rank 0's DNS name, the owner of the pods, and the launch
record in an annotation) and one pod per replica bound to its node (see `pods.py`); a single
replica that holds no ResourceClaim is its own record, without a Service (decision 0028).
Nothing is kept locally: any process finds an attempt again by its labels (`reattach`), and
what a poller decides (the gang's failure, a stop) is written on the record, so that every
later poll, from any process, tells the same story.

All or nothing at run time, as Kueue's waitForPodsReady: `poll` tears the attempt down when
not every replica is Running `start_timeout_s` after launch, and when any replica fails; the
status says which replica failed, why, and whether to fail, retry or requeue (`status.py`).
`poll` enforces these (the completion trigger polls); the kubelet enforces the time limit by
itself (`activeDeadlineSeconds`). Replicas hold exactly the engine's GPUs through
ResourceClaims where the cluster serves DRA (`claims.py`), and read staged inputs from the
team's data volume, which `stage_inputs` fills with a staging pod (`staging.py`, decision 0008).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from berth.runtime.base import Launch, LaunchError, LogCursor, RuntimeUnavailable, check_launch
from berth.runtime.kubernetes import orphans, watched
from berth.runtime.kubernetes import pods as manifests
from berth.runtime.kubernetes import record as rec
from berth.runtime.kubernetes import status as fate
from berth.runtime.kubernetes.claims import AttemptClaims
from berth.runtime.kubernetes.parallel import side_by_side
from berth.runtime.kubernetes.pod_logs import LogsUnavailable as LogsUnavailable
from berth.runtime.kubernetes.pod_logs import gang_lines
from berth.runtime.kubernetes.pods import (
    FAILURE,
    JOB_ID,
    LAUNCH,
    STOPPED,
    KubeLaunch,
    KubeReplica,
)
from berth.runtime.kubernetes.reads import (
    UNAVAILABLE,
    created_uid,
    unavailable,
    unavailable_as,
    unless_gone,
    without_body,
)
from berth.runtime.kubernetes.staging import Stager
from berth.runtime.kubernetes.status import KubeGangStatus, api_problem, failure_record
from berth.runtime.kubernetes.training import shm_mib
from berth.runtime.kubernetes.volumes import replica_input_env
from berth.runtime.kubernetes.watch import AttemptKey, ClusterWatch
from berth.spec import JobSpec
from berth.staging import StagedInputs
from scheduling.cluster import Cluster
from scheduling.jobs import Placement


class KubernetesRuntime:
    """Runs gangs as pods in each team's namespace; see the module docstring."""

    def __init__(
        self,
        api: client.ApiClient,
        settings: manifests.KubeSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        watch: ClusterWatch | None = None,
        model_label: str | None = None,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.settings = settings or manifests.KubeSettings()
        # The node label naming a node's GPUs (discovery's `gpu_product`): pods select their
        # node's value of it.
        self.model_label = model_label
        self.clock = clock  # wall clock, as Launch.launched_at
        # The process's list-and-watch of pods, Services and nodes (watch.py): `poll` reads
        # "still running" from it, the API server for anything else; None reads the API always.
        self.watch = watch
        self._seen: dict[AttemptKey, int] = {}  # the watch's generation each cached poll read
        self.claims = AttemptClaims(api, self.settings.dra)
        self.stager = Stager(self.core, self.settings)

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
        mount_data: bool = False,
        shm_gb: float | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> KubeLaunch:
        """Create the attempt's Service, then per replica its ResourceClaim (where DRA applies)
        and its pod on its node; returns at once (`poll` watches the start). `workdir` is
        ignored (the image's, or the attempt's folder on `outputs_volume`); `mount_data`: the
        team's data volume, read-only; `shm_gb`: each replica's /dev/shm (None: half its
        memory); the job's checkpoint folder where the settings name a checkpoint volume
        (`training.py`); `secrets`: variables from the namespace's Secrets ('name/key', the
        spec's `secrets`). A GPU that another claim holds is a `rejected` failure on the
        Service (requeued), nothing more.

        Raises LaunchError for bad input, an attempt launched before, or a refused object (what
        was created is deleted first: no partial gangs); RuntimeUnavailable when the API server
        is away (no answer, 429, 5xx): not the job's fault, launch it again as a new attempt.
        """
        check_launch(job_id, attempt, command, placement, cluster, env, extra_env, time_limit_s)
        manifests.check_secrets(secrets or {}, {**env, **(extra_env or {})})
        if not image:
            raise LaunchError("image: the Kubernetes runtime runs a container image; set `image`")
        if not team:
            raise LaunchError("team: required, it picks the namespace; pass the job's team")
        if not (cpus > 0 and memory_gb > 0):
            raise LaunchError(f"cpus, memory_gb: must be > 0, got {cpus}, {memory_gb}")
        if shm_gb is not None and not 0 < shm_gb <= memory_gb:
            raise LaunchError(
                f"shm_gb: {shm_gb} must be more than 0 and at most memory_gb ({memory_gb}): "
                "/dev/shm's pages count against the replica's memory"
            )
        namespace = self.namespace(team)
        try:
            with unavailable_as("the team's volumes could not be read"):
                volumes = self.stager.launch_claims(namespace, team, mount_data=mount_data)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        launch = manifests.new_launch(
            self.settings, job_id, attempt, placement, cluster, namespace=namespace,
            team=team, image=image, launched_at=self.clock(), time_limit_s=time_limit_s,
            shm_mib=shm_mib(shm_gb, memory_gb), model_label=self.model_label, **volumes,
        )  # fmt: skip
        with unavailable_as("the GPUs' devices could not be read"):
            plan = self.claims.plan(launch)
        launch, service = plan.launch, launch.service
        cpu, mem = manifests.engine_units(cpus, memory_gb)
        variables = dict(env) | dict(extra_env or {})
        if plan.conflict is None and (own := manifests.pod_record(launch)).record == "pod":
            body = manifests.pod_manifest(
                self.settings, own, own.replicas[0], list(command), variables, cpu, mem, "",
                secrets,
            )  # fmt: skip
            rec.create_pod(self.core, own, body)
            return own
        body = manifests.service_manifest(launch)
        if plan.conflict is not None:
            body["metadata"]["annotations"][FAILURE] = json.dumps(plan.conflict)
        try:
            uid = created_uid(self.core.create_namespaced_service, namespace, body)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise RuntimeUnavailable(
                f"the attempt's Service could not be created, the API server being away: {e}"
            ) from None
        except ApiException as e:
            if e.status in UNAVAILABLE:
                raise RuntimeUnavailable(f"the attempt's Service: {api_problem(e)}") from None
            if e.status == 409:
                raise LaunchError(
                    f"job {job_id!r} attempt {attempt} was launched before (Service "
                    f"{namespace}/{service}); reattach(job_id, attempt) to follow it, or launch "
                    "a new attempt number"
                ) from None
            raise LaunchError(f"the attempt's Service was refused: {api_problem(e)}") from None
        if plan.conflict is not None:
            return launch  # `poll` tells the failure; no pod may take a held GPU

        def create(rep: KubeReplica) -> tuple[KubeReplica, str, Exception] | None:
            """The replica's claim (where DRA applies) and pod; what failed, or None."""
            body = manifests.pod_manifest(
                self.settings, launch, rep, list(command), variables, cpu, mem, uid, secrets
            )
            what = "ResourceClaim"
            try:
                if rep.claim is not None:
                    self.claims.create(plan, rep, uid)
                what = "pod"
                if rep.claim is None:  # nothing reads the answer
                    without_body(self.core.create_namespaced_pod, namespace, body)
                else:
                    pod = self.core.create_namespaced_pod(namespace, body)
                    what = "ResourceClaim's allocation"
                    self.claims.bind(plan, rep, pod)
            except Exception as e:  # refused, or the connection broke: told below
                return rep, what, e
            return None

        # The replicas at once (each an independent request or three): a 64-replica gang
        # starts in a few round trips instead of 64 in a row.
        made = side_by_side(create, launch.replicas)
        failed = [m for m in made if m is not None]
        if failed:  # no half gang is left: delete whatever was made, then say why
            rep, what, e = failed[0]  # the lowest rank's failure
            refused = isinstance(e, ApiException)
            why = api_problem(e) if refused else f"{type(e).__name__}: {e}"
            try:
                self._delete(launch, 0, service=True)
            except Exception as cleanup:  # the Service owns the rest: name it for a person
                why += (
                    f"; deleting the attempt failed too ({type(cleanup).__name__}), so "
                    f"delete Service {namespace}/{service} (it owns the pods and claims)"
                )
            told = f"rank {rep.rank}'s {what} {'was refused' if refused else 'failed'}"
            if unavailable(e):  # not the job's fault: run it again, as a new attempt
                raise RuntimeUnavailable(f"{told}, the API server being away: {why}") from None
            raise LaunchError(f"{told}, so the attempt was deleted: {why}") from None
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
        staged_root: PurePath | str | None = None,
    ) -> KubeLaunch:
        """`launch` with what a JobSpec says (image, team, command, resources, env, limit).

        A job with `inputs` mounts the team's data volume; `extra_env` then holds the staged
        inputs' variables (`StagedInputs.env()`), whose paths are moved into the mount from
        `staged_root`, the directory they were staged under (None: by `stage_inputs`, whose
        paths already are in the mount)."""
        if spec.image is None:
            raise LaunchError(
                "image: the Kubernetes runtime runs container images; build the job's "
                "`environment` into an image and set `image` instead"
            )
        extra, volume = dict(extra_env or {}), self.settings.data_volume
        try:
            extra = replica_input_env(extra, len(spec.inputs), volume, staged_root)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        return self.launch(
            job_id, attempt, spec.command, placement, cluster,
            env=spec.env, extra_env=extra, time_limit_s=spec.time_limit_s,
            image=spec.image, team=spec.team, cpus=spec.cpus_per_replica,
            memory_gb=spec.memory_gb_per_replica, mount_data=bool(spec.inputs),
            shm_gb=spec.shm_gb_per_replica, secrets=spec.secrets,
        )  # fmt: skip

    def stage_inputs(self, team: str, inputs: Sequence[str]) -> StagedInputs:
        """Stage `inputs` into the team's data volume with a staging pod and return where
        replicas read them (pass `.env()` as `launch_spec`'s extra_env). Raises StagingError
        for the inputs' problems, StagingPodFailed for the pod's, ValueError for settings."""
        return self.stager.stage(team, inputs)

    # ---- follow -------------------------------------------------------------------------

    def poll(self, launch: Launch) -> KubeGangStatus:
        """The gang now. On its first failure (or a start timeout, or the time limit) the
        failure is written on the attempt's record (its Service, or its only pod) and every
        replica still running is deleted with the grace period before this returns.

        With a fresh watch, a gang whose objects there say it is running, or that every pod
        succeeded (a terminal phase), is answered from memory; every other answer (a failure,
        a missing object, a timeout) is read from the API server, so the watch can delay such
        an end (by its lag) but never decide it. RuntimeUnavailable when the API server cannot
        be reached or answers 429 or 5xx: nothing is known, ask again."""
        launch = manifests.kube_launch(launch)
        known, seen = watched.gang_from_watch(self.watch, launch, self.clock())
        key = watched.attempt_key(launch)
        if known is not None:
            self._seen[key] = seen  # what `changed` waits to move past
            return known
        self._seen.pop(key, None)
        with unavailable_as("the gang's state cannot be told for now"):
            return self._poll_api(launch)

    def _poll_api(self, launch: KubeLaunch) -> KubeGangStatus:
        """`poll` from the API server. Each step is one a later poll, from any process, takes
        up again (the failure is on the record before any pod is deleted), so an API server
        that goes away midway leaves nothing half decided. An attempt that is its own pod
        cannot tell a stop from a deletion once the pod is gone: that reads as `deleted`, a
        requeue, and the store's state (a stop or preemption it asked for) stands over it."""
        by_rank = self._pods(launch)
        own_pod = launch.record == "pod"
        owner = rec.read(self.core, launch, by_rank)
        common = {"started_at": launch.launched_at, "time_limit_s": launch.time_limit_s}
        notes = (owner and owner.metadata.annotations) or {}
        if (owner is None and not own_pod) or STOPPED in notes or FAILURE in notes:
            if any(p.metadata.deletion_timestamp is None and _running(p) for p in by_rank.values()):
                self._delete(launch, self.settings.grace_s, by_rank=by_rank, only_running=True)
                by_rank = self._pods(launch)
            replicas = fate.gang_statuses(launch, by_rank, ending=True)
            if FAILURE in notes:
                record = json.loads(notes[FAILURE])
                return KubeGangStatus(state="failed", replicas=replicas, **common, **record)
            told = "stopped on request" if owner else "stopped: its Service is gone"
            return KubeGangStatus(state="stopped", replicas=replicas, **common, message=told)
        alive = self._nodes_alive(launch, by_rank)
        failures = fate.gang_failures(launch, by_rank, alive, self.clock())
        if failures:
            record = rec.write_failure(
                self.core, launch, owner, failure_record(failures), lambda: self._pods(launch)
            )
            self._delete(launch, self.settings.grace_s, by_rank=by_rank, only_running=True)
            by_rank = self._pods(launch)
            replicas = fate.gang_statuses(launch, by_rank, ending=True)
            return KubeGangStatus(state="failed", replicas=replicas, **common, **record)
        replicas = fate.gang_statuses(launch, by_rank, ending=False)
        done = all(s.state == "exited" and s.exit_code == 0 for s in replicas)
        return KubeGangStatus(state="succeeded" if done else "running", replicas=replicas, **common)

    async def changed(self, launch: Launch, timeout_s: float) -> None:
        """Return when one of the attempt's objects has changed since the last `poll` read
        it from the watch, or after `timeout_s` (at once if it changed already). Without a
        fresh watch, or after a poll that read the API server: after `timeout_s`. Starts the
        watch if it is not yet."""
        launch = manifests.kube_launch(launch)
        key = watched.attempt_key(launch)
        since = self._seen.pop(key, None)
        if self.watch is not None and not self.watch.started:
            # The first waiter starts the process's watch: a process that only launches (a
            # worker's task) never lists every pod and node of the cluster for nothing.
            self.watch.start()
        if self.watch is None or since is None or not self.watch.fresh():
            await asyncio.sleep(timeout_s)
            return
        await self.watch.changed(key, since, timeout_s)

    def stop(self, launch: Launch, grace_s: float | None = None) -> None:
        """Delete the attempt's pods with a grace period (SIGTERM, then SIGKILL after
        `grace_s`, default the settings': time to checkpoint), then its Service (if it has
        one). Idempotent; RuntimeUnavailable when the API server is away (stop again later)."""
        launch = manifests.kube_launch(launch)
        self._seen.pop(watched.attempt_key(launch), None)
        grace = self.settings.grace_s if grace_s is None else grace_s
        ns = launch.namespace
        ended = watched.end_phases(self.watch, launch)
        grace = 0 if ended else grace  # no container left to signal: removed at once
        own_pod = launch.record == "pod"
        with unavailable_as("the attempt could not be stopped for now"):
            if ended == {"Succeeded"}:
                # The Service goes first, which tells a later poll "stopped" as the annotation
                # would, for one request less (a failed gang's Service holds its failure
                # record, which polls read until the end: not this way). An attempt that is
                # its own pod has nothing left to tell: the pod goes.
                if not own_pod:
                    self._delete_one("service", ns, launch.service)
                self._delete(launch, 0)
                self.claims.delete(launch)
                return
            rec.annotate(self.core, launch, {STOPPED: str(self.clock())})
            self._delete(launch, grace, service=not own_pod)

    def logs(self, launch: Launch, cursor: LogCursor | None = None) -> tuple[list[str], LogCursor]:
        """Complete new lines of every started rank's log since `cursor`, as `[rank i] line`;
        raises LogsUnavailable when the API server cannot read one (`pod_logs.py`)."""
        launch = manifests.kube_launch(launch)
        return gang_lines(self.core, launch, self._pods_seen(launch), cursor)

    def reattach(self, job_id: str, attempt: int, *, team: str | None = None) -> KubeLaunch | None:
        """The handle of a launched attempt from its record (its Service's, or its only pod's);
        None if none. Without `team` the namespace is found from the attempt's pods
        (cluster-wide, by label)."""
        if team is not None:
            namespaces = [self.namespace(team)]
        else:
            found = self.core.list_pod_for_all_namespaces(
                label_selector=manifests.selector(job_id, attempt)
            )
            namespaces = sorted({p.metadata.namespace for p in found.items})
        service = manifests.attempt_name(job_id, attempt)
        for namespace in namespaces:
            owner = rec.find(self.core, service, namespace)
            if owner is None:
                continue
            notes = owner.metadata.annotations or {}
            if notes.get(JOB_ID) == job_id and LAUNCH in notes:
                return KubeLaunch.from_dict(json.loads(notes[LAUNCH]))
        return None

    def launch_from_dict(self, data: Mapping[str, Any]) -> KubeLaunch:
        return KubeLaunch.from_dict(data)

    def cleanup_orphans(
        self,
        known_live: set[tuple[str, int]],
        namespaces: Iterable[str] | None = None,
        *,
        keep_s: float = 0.0,
    ) -> list[str]:
        """Delete Berth's pods, Services and ResourceClaims of attempts not in `known_live`
        ((job id, attempt) pairs the store considers live) in `namespaces` (the teams'); returns
        'namespace/kind/name' of each deleted.

        An attempt with an object created, or a replica ended, less than `keep_s` ago (by this
        runtime's clock) is left for now: a finished attempt stays readable (`kubectl logs`)
        that long, and an attempt launched after `known_live` was read is not taken for an
        orphan. None for `namespaces`: every namespace where Berth's pods are found
        (cluster-wide); a Service whose pods are all gone is then missed, so pass the teams'
        namespaces when they are known."""
        return orphans.sweep(
            self.core, self.claims, known_live, namespaces, keep_s=keep_s, now=self.clock(),
            delete=lambda kind, ns, name: self._delete_one(
                kind, ns, name, self.settings.grace_s if kind == "pod" else 0
            ),
        )  # fmt: skip

    # ---- helpers ------------------------------------------------------------------------

    def _pods(self, launch: KubeLaunch) -> dict[int, Any]:
        """This attempt's pods by rank (those of a same-named attempt of another id excluded)."""
        found = self.core.list_namespaced_pod(
            launch.namespace, label_selector=manifests.selector(launch.job_id, launch.attempt)
        )
        names = {r.pod: r.rank for r in launch.replicas}
        return {names[p.metadata.name]: p for p in found.items if p.metadata.name in names}

    def _pods_seen(self, launch: KubeLaunch) -> dict[int, Any]:
        """`_pods` from a fresh watch when it holds every replica, else from the API server."""
        found = watched.pods(self.watch, launch)
        return found if found is not None else self._pods(launch)

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
        pod keeps its status for people to read), then its claims and Service when `service`."""
        for rep in launch.replicas:
            pod = by_rank.get(rep.rank) if by_rank is not None else None
            if by_rank is not None and pod is None:
                continue
            if only_running and pod is not None and not _running(pod):
                continue
            self._delete_one("pod", launch.namespace, rep.pod, grace_s)
        if service:
            self.claims.delete(launch)
            self._delete_one("service", launch.namespace, launch.service)

    def _delete_one(self, kind: str, namespace: str, name: str, grace_s: float = 0) -> None:
        call = getattr(self.core, f"delete_namespaced_{kind}")  # pod, service
        unless_gone(call, name, namespace, grace_period_seconds=round(grace_s))


def _running(pod: Any) -> bool:
    return pod.status.phase in ("Pending", "Running")
