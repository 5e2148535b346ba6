"""Building an `environment` job's image in the cluster, once per build context.

`ImageBuilder.ensure` is what the lifecycle's prepare step calls on Kubernetes:

1. **Present?** The image's name comes from its context's digest (`images.py`); the registry is
   asked (`registry.py`, a manifest HEAD) and an image already there is used as it is: no pod.
2. **Build.** Otherwise a Kaniko executor pod builds it in the team's namespace (or
   BERTH_BUILD_NAMESPACE) and pushes it: the context travels in a ConfigMap mounted at
   /workspace (Kaniko reads it as a `tar://` context), the push credentials in the docker-config
   Secret the admin names (mounted by name: the runtime needs no right to read Secrets), and
   Kaniko writes the pushed digest to the termination message (`--digest-file`).
3. **Once.** The pod's name is fixed by the context digest, so a second job that needs the same
   image while it is being built gets 409 on create, finds the first job's pod and waits for
   it. A failed pod is kept for people to read (its log, its termination message) until the
   next build of the same context replaces it, or `keep_failed_s` has passed.

Kaniko runs as root inside its container (it unpacks the base image and runs the Dockerfile's
steps as the image's users, with no daemon): Pod Security "restricted" refuses it, "baseline"
admits it. So builds need an admin's explicit yes (BERTH_BUILD_ALLOW_ROOT) and a namespace that
enforces at most "baseline"; the jobs' own pods stay restricted (their manifests, `pods.py`).
The builder pod gets no service-account token, no privilege escalation, RuntimeDefault seccomp,
resource limits and a deadline (`activeDeadlineSeconds`); the ConfigMap is owned by the pod, so
deleting the pod deletes it too.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from berth.runtime.kubernetes import build_manifests as manifests
from berth.runtime.kubernetes.build_manifests import BuildRequest
from berth.runtime.kubernetes.images import BuildContext, ImageBuildSettings, tag_for
from berth.runtime.kubernetes.pods import KubeSettings, namespace_for
from berth.runtime.kubernetes.reads import read_or_none
from berth.runtime.kubernetes.registry import RegistryClient, credentials_for
from berth.runtime.kubernetes.status import CONFIG_ERRORS, IMAGE_ERRORS, api_problem

log = logging.getLogger(__name__)
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
LOG_LINES = 20  # of a failed builder's log, quoted in the error
_ATTEMPTS = 3  # create-or-join rounds (a pod replaced or deleted under us)


class BuildError(RuntimeError):
    """The image could not be built; the message says why and what to do. `retryable` is False
    when building again cannot help (a requirement pip cannot install, a refused pod, a builder
    image that cannot be pulled)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class BuildResult:
    """The image of a build context: its tag reference, the manifest digest, and how it came
    to be: already in the registry, built by this call's pod, or by another job's pod."""

    image: str
    digest: str
    outcome: Literal["present", "built", "joined"]
    pod: str | None = None

    @property
    def pinned(self) -> str:
        """`image@digest`: what the replicas run, so that a later push to the tag cannot
        change an attempt's image."""
        return f"{self.image}@{self.digest}"


class ImageBuilder:
    """Builds build contexts into images with Kaniko pods; see the module docstring."""

    def __init__(
        self,
        api: client.ApiClient,
        settings: ImageBuildSettings,
        kube: KubeSettings | None = None,
        *,
        registry: RegistryClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.settings = settings
        self.kube = kube or KubeSettings()
        self.registry = registry or RegistryClient(
            settings.registry,
            insecure=settings.insecure,
            credentials=credentials_for(settings.registry, settings.auth_file),
        )
        self.clock, self.sleep = clock, sleep

    def namespace(self, team: str) -> str:
        """Where the team's builds run: BERTH_BUILD_NAMESPACE, else the team's namespace."""
        if self.settings.namespace:
            return self.settings.namespace
        try:
            return namespace_for(self.kube, team)
        except ValueError as e:
            raise BuildError(str(e), retryable=False) from None

    def ensure(
        self,
        context: BuildContext,
        team: str,
        *,
        requested_by: Mapping[str, str] | None = None,
        logger: logging.Logger | None = None,
    ) -> BuildResult:
        """The image of `context`, from the registry when it is there, else built (or waited
        for, when another job's builder pod builds the same context). BuildError otherwise."""
        out = logger or log
        image = self.settings.reference(context.digest, team)
        repository = self.settings.repository_for(team)
        found = self.registry.manifest_digest(repository, tag_for(context.digest))
        if found:
            out.info("image %s is in the registry (%s): nothing to build", image, found)
            return BuildResult(image, found, "present")
        if not self.settings.allow_root:
            raise BuildError(
                f"BERTH_BUILD_ALLOW_ROOT: image {image} must be built, and Kaniko runs as root "
                "in its pod; an admin allows that with BERTH_BUILD_ALLOW_ROOT=1 (the namespace "
                "must then admit Pod Security 'baseline'), or the job gives a prebuilt `image`",
                retryable=False,
            )
        per_team = team if "{team}" in self.settings.repository else None
        request = BuildRequest(
            namespace=self.namespace(team), name=manifests.builder_name(context.digest, per_team),
            team=team, image=image, context=context, requested_by=dict(requested_by or {}),
        )  # fmt: skip
        for _ in range(_ATTEMPTS):
            pod, created = self._create_or_join(request, out)
            result = self._wait(request, pod, "built" if created else "joined", out)
            if result is not None:
                return result
        raise BuildError(
            f"builder pod {request.namespace}/{request.name} was deleted {_ATTEMPTS} times before "
            "it finished, by someone other than this job; check who deletes it",
            retryable=True,
        )

    # ---- create, or join the build already running ---------------------------------------

    def _create_or_join(self, req: BuildRequest, out: logging.Logger) -> tuple[Any, bool]:
        for _ in range(_ATTEMPTS):
            try:
                pod = self.core.create_namespaced_pod(
                    req.namespace, manifests.pod_manifest(self.settings, req)
                )
            except ApiException as e:
                if e.status != 409:
                    raise self._refused(req, e) from None
                existing = self._read(req)
                if existing is None:
                    continue  # deleted in between: create again
                if existing.status.phase == "Failed":  # an earlier build failed: a new try
                    out.info("builder pod %s/%s failed before; building again", req.namespace,
                             req.name)  # fmt: skip
                    self._delete(req.namespace, req.name, existing.metadata.uid)
                    continue
                out.info("image %s is being built by builder pod %s/%s of another job; waiting "
                         "for it", req.image, req.namespace, req.name)  # fmt: skip
                return existing, False
            self._put_context(req, pod.metadata.uid)
            self._forget_old_failures(req)
            out.info("building image %s in builder pod %s/%s", req.image, req.namespace, req.name)
            return pod, True
        raise BuildError(
            f"builder pod {req.namespace}/{req.name} kept being replaced while this job tried "
            "to create it; try again",
            retryable=True,
        )

    def _put_context(self, req: BuildRequest, owner_uid: str) -> None:
        """The context's ConfigMap, owned by the new pod (a stale one, owned by a deleted pod
        that the garbage collector has not reached yet, is replaced)."""
        body = manifests.config_map_manifest(req, owner_uid)
        try:
            try:
                self.core.create_namespaced_config_map(req.namespace, body)
                return
            except ApiException as e:
                if e.status != 409:
                    raise
            try:
                self.core.replace_namespaced_config_map(req.name, req.namespace, body)
            except ApiException as e:
                if e.status != 404:  # the stale one went in between: create it after all
                    raise
                self.core.create_namespaced_config_map(req.namespace, body)
        except ApiException as e:  # no context, no build: the pod must not wait for it
            self._delete(req.namespace, req.name, owner_uid)
            raise self._refused(req, e, what="ConfigMap") from None

    # ---- wait ------------------------------------------------------------------------------

    def _wait(
        self, req: BuildRequest, pod: Any, outcome: Literal["built", "joined"], out: logging.Logger
    ) -> BuildResult | None:
        """The result once the pod succeeded (or its image appeared); None when the pod went
        away without an image (the caller creates a new one); BuildError on failure."""
        uid = pod.metadata.uid
        started = self.clock()
        while True:
            if pod is None or pod.metadata.uid != uid:  # finished and deleted, or replaced
                found = self.registry.manifest_digest(
                    self.settings.repository_for(req.team), tag_for(req.context.digest)
                )
                if found:  # the pod waited on pushed it (another waiter deleted it first)
                    return BuildResult(req.image, found, outcome, req.name)
                if pod is None:
                    return None
                uid, outcome, started = pod.metadata.uid, "joined", self.clock()
                continue
            phase = pod.status.phase if pod.status else None
            if phase == "Succeeded":
                digest = self._pushed_digest(req, pod)
                self._delete(req.namespace, req.name, uid)
                out.info("built image %s (%s)", req.image, digest)
                return BuildResult(req.image, digest, outcome, req.name)
            if phase == "Failed":
                raise self._failed(req, pod)
            waited = self.clock() - started
            if phase in (None, "Pending"):
                self._check_start(req, pod, waited)
            if waited > self.settings.start_timeout_s + self.settings.timeout_s:
                self._delete(req.namespace, req.name, uid)
                raise BuildError(
                    f"builder pod {req.namespace}/{req.name} did not finish within "
                    f"{self.settings.timeout_s:g} s (BERTH_BUILD_TIMEOUT_S) and was deleted; a "
                    "big environment may need more time",
                    retryable=True,
                )
            self.sleep(self.settings.poll_s)
            pod = self._read(req)

    def _check_start(self, req: BuildRequest, pod: Any, waited: float) -> None:
        """BuildError for a pod that cannot start (deleted first: it would only wait)."""
        where = f"builder pod {req.namespace}/{req.name}"
        for status in pod.status.container_statuses or () if pod.status else ():
            waiting = status.state and status.state.waiting
            reason = waiting.reason if waiting else None
            if reason in IMAGE_ERRORS or reason in CONFIG_ERRORS:
                self._delete(req.namespace, req.name, pod.metadata.uid)
                image = reason in IMAGE_ERRORS
                setting = "BERTH_BUILD_KANIKO_IMAGE" if image else "BERTH_BUILD_PUSH_SECRET"
                raise BuildError(
                    f"{setting}: {where} could not start its container ({reason}: "
                    f"{waiting.message or 'no message'}); check {setting} "
                    f"({getattr(self.settings, _FIELD[setting])})",
                    retryable=False,
                )
        if waited > self.settings.start_timeout_s:
            self._delete(req.namespace, req.name, pod.metadata.uid)
            raise BuildError(
                f"{where} did not start within {self.settings.start_timeout_s:g} s and was "
                "deleted; check that the Secret named by BERTH_BUILD_PUSH_SECRET "
                f"({self.settings.push_secret}) exists in {req.namespace} (kubectl describe pod "
                "shows a FailedMount otherwise), and that a node has room for "
                f"{self.settings.cpu} CPU and {self.settings.memory} of memory",
                retryable=True,
            )

    def _pushed_digest(self, req: BuildRequest, pod: Any) -> str:
        """The digest Kaniko wrote to the termination message, else the registry's answer."""
        term = manifests.terminated(pod)
        message = (term.message or "").strip() if term else ""
        if DIGEST.fullmatch(message):
            return message
        repository = self.settings.repository_for(req.team)
        found = self.registry.manifest_digest(repository, tag_for(req.context.digest))
        if not found:
            raise BuildError(
                f"builder pod {req.namespace}/{req.name} succeeded but the registry has no "
                f"{req.image}; check that BERTH_BUILD_REGISTRY is the registry Kaniko pushes to",
                retryable=True,
            )
        return found

    def _failed(self, req: BuildRequest, pod: Any) -> BuildError:
        term = manifests.terminated(pod)
        code = term.exit_code if term else None
        message = (term.message or "").strip() if term else ""
        reason = (pod.status.reason or "") if pod.status else ""
        why = "it ran past BERTH_BUILD_TIMEOUT_S" if reason == "DeadlineExceeded" else (
            f"exit code {code}" if code is not None else reason or "no reason given"
        )  # fmt: skip
        text = f"building image {req.image} failed in pod {req.namespace}/{req.name} ({why})"
        if message:
            text += f"; its termination message:\n{message}"
        text += "\n" + self._log_tail(req)
        # Kaniko says 'failed to execute command' when a Dockerfile step (pip) fails: the
        # requirements need fixing. Anything else (a push refused, a timeout) may pass later.
        pip_failed = "failed to execute command" in message
        if pip_failed:
            text += "\nenvironment.requirements: pip could not install them; check the names"
        text += f"\nThe pod is kept for reading: kubectl -n {req.namespace} logs {req.name}"
        return BuildError(text, retryable=not pip_failed)

    def _log_tail(self, req: BuildRequest) -> str:
        try:
            raw = self.core.read_namespaced_pod_log(
                req.name, req.namespace, container=manifests.CONTAINER, tail_lines=LOG_LINES,
                _request_timeout=30,
            )  # fmt: skip
        except ApiException as e:
            return f"(its log cannot be read through the API server: {api_problem(e)})"
        return f"the last lines of its log:\n{raw}" if raw else "(its log is empty)"

    # ---- helpers ---------------------------------------------------------------------------

    def _read(self, req: BuildRequest) -> Any | None:
        return read_or_none(self.core.read_namespaced_pod, req.name, req.namespace)

    def _delete(self, namespace: str, name: str, uid: str) -> None:
        """Delete the builder pod with this uid (not a newer one of the same name) and its
        ConfigMap, if that is still the one this pod owns."""
        manifests.delete_exact(self.core.delete_namespaced_pod, name, namespace, uid)
        cm = read_or_none(self.core.read_namespaced_config_map, name, namespace)
        if cm is None:
            return
        if any(o.uid == uid for o in cm.metadata.owner_references or ()):
            manifests.delete_exact(
                self.core.delete_namespaced_config_map, name, namespace, cm.metadata.uid
            )

    def _forget_old_failures(self, req: BuildRequest) -> None:
        """Delete Berth's failed builder pods in the namespace that ended over keep_failed_s
        ago (people had their time to read them)."""
        found = self.core.list_namespaced_pod(req.namespace, label_selector=manifests.SELECTOR)
        now = time.time()  # wall clock, as the kubelet's finishedAt
        for pod in found.items:
            term = manifests.terminated(pod)
            ended = term.finished_at.timestamp() if term and term.finished_at else now
            if pod.status.phase == "Failed" and now - ended > self.settings.keep_failed_s:
                meta = pod.metadata
                self._delete(meta.namespace, meta.name, meta.uid)

    def _refused(self, req: BuildRequest, e: ApiException, what: str = "pod") -> BuildError:
        problem = api_problem(e)
        if "PodSecurity" in problem:
            return BuildError(
                f"namespace {req.namespace} enforces Pod Security 'restricted', which refuses "
                "Kaniko's root container; label it pod-security.kubernetes.io/enforce=baseline "
                "(Berth's job pods stay restricted by their own settings), or set "
                f"BERTH_BUILD_NAMESPACE to a namespace for builds: {problem}",
                retryable=False,
            )
        if e.status == 403:
            return BuildError(
                f"the builder {what} was refused in {req.namespace}: {problem}; bind the "
                f"ClusterRole berth-builder-team there (Berth's chart with builds.enabled, and "
                f"`berth kube manifests --builds`)",
                retryable=False,
            )
        return BuildError(f"the builder {what} was refused: {problem}", retryable=e.status >= 500)


_FIELD = {"BERTH_BUILD_KANIKO_IMAGE": "kaniko_image", "BERTH_BUILD_PUSH_SECRET": "push_secret"}
