"""What an `environment` job's image is: its build settings, its build context, and its name.

On Kubernetes a job that gives `environment` (pip requirements, optional Python version) runs in
an image Berth builds in the cluster (`build.py`). The build context is generated here: a
Dockerfile `FROM` the admin's base image (by default the job base of docker/job-base) that
pip-installs the requirements, and the requirements file. Its content digest (sha256 over a
canonical tarball of those files, whose Dockerfile holds the base image's reference) names the
image, `<registry>/<repository>:<first 32 hex digits>`: jobs that ask for the same packages on
the same base share one image, and a changed list or base gets a new one. Pure functions over
validated settings; nothing here touches the network.

The settings are the admin's, read once from `BERTH_BUILD_*` variables (`from_env`); a bad one
fails with the variable's name and the fix.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from berth.spec import Environment
from berth.spec_fields import image_ref

RECIPE = 1  # bump when the generated Dockerfile changes meaning: every image is built anew
TAG_HEX = 32  # hex digits of the context digest in the tag (128 bits)
CONTEXT_LIMIT = 900 * 1024  # bytes of gzipped context a ConfigMap carries (its cap is 1 MiB)
# The community fork that continues Kaniko since Google archived it (June 2025); same executor
# flags, one repository with the flavours as tag suffixes (docs/decisions/0026).
DEFAULT_KANIKO = "ghcr.io/osscontainertools/kaniko:v1.28.2"
JOB_BASE = "berth/job-base:0.1.0"  # docker/job-base, as docker/README.md pushes it
_HOST = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?"
)
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_QUANTITY = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_USER = re.compile(r"[0-9]+(?::[0-9]+)?")
_DNS_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")


class ImageSettingsError(ValueError):
    """A BERTH_BUILD_* setting is not valid; the message names the variable and the fix."""


class BuildConfigError(ValueError):
    """The job's environment cannot be built with these settings; the message names the field
    (or setting) and the fix. Retrying does not help."""


def _registry(v: str) -> str:
    if "://" in v or "/" in v or not _HOST.fullmatch(v):
        raise ValueError(
            f"must be a registry host, optionally with a port, without scheme or path, got {v!r}; "
            "e.g. 'registry.example.com' or 'registry.example.com:5000' (put the path in "
            "BERTH_BUILD_REPOSITORY)"
        )
    return v


def _repository(v: str) -> str:
    # '{team}' is replaced by the job's team: one repository (and push login) per team.
    if len(v) > 255 or not _REPOSITORY.fullmatch(v.replace("{team}", "team")):
        raise ValueError(
            f"must be a repository path of lowercase letters, digits and '.', '_' or '-' "
            f"separated by '/', without registry or tag, got {v!r}; e.g. 'berth/envs', or "
            "'berth/{team}/envs' for one repository per team"
        )
    return v


def _pinned(v: str) -> str:
    image_ref(v)
    last = v.rsplit("/", 1)[-1]
    tag = last.split("@", 1)[0].partition(":")[2]
    if "@" not in last and tag in ("", "latest"):
        raise ValueError(
            f"must be pinned to a version tag or a digest (a builder that changes under you "
            f"changes every image), got {v!r}; e.g. {DEFAULT_KANIKO!r}"
        )
    return v


def _matches(pattern: re.Pattern[str], example: str) -> Any:
    def check(v: str) -> str:
        if not pattern.fullmatch(v):
            raise ValueError(f"got {v!r}; e.g. {example!r}")
        return v

    return AfterValidator(check)


class ImageBuildSettings(BaseModel):
    """The admin's settings for building `environment` images in the cluster (validated once;
    `from_env` reads them from `ENV`'s variables)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    registry: Annotated[str, AfterValidator(_registry)]
    repository: Annotated[str, AfterValidator(_repository)] = "berth/envs"
    # None: <registry>/berth/job-base:0.1.0, the image built from docker/job-base/Dockerfile
    base_image: Annotated[str, AfterValidator(image_ref)] | None = None
    base_python: Annotated[str, _matches(re.compile(r"3\.[0-9]{1,2}"), "3.11")] = "3.11"
    base_user: Annotated[str, _matches(_USER, "1000:1000")] = "1000:1000"  # restored after pip
    kaniko_image: Annotated[str, AfterValidator(_pinned)] = DEFAULT_KANIKO
    push_secret: Annotated[str, _matches(_DNS_NAME, "berth-registry")] | None = None
    auth_file: Path | None = None  # docker config.json for Berth's own registry requests
    insecure: bool = False  # plain HTTP to the registry (a test registry; never in production)
    allow_root: bool = False  # Kaniko runs as root in its pod: an admin must say yes
    namespace: Annotated[str, _matches(_DNS_NAME, "berth-builds")] | None = None  # None: team's
    timeout_s: float = Field(1800.0, gt=0)
    start_timeout_s: float = Field(300.0, gt=0)  # Pending longer: the pod cannot start
    keep_failed_s: float = Field(86400.0, ge=0)  # failed builder pods kept for reading
    poll_s: float = Field(2.0, gt=0)
    cpu: Annotated[str, _matches(_QUANTITY, "2")] = "2"
    memory: Annotated[str, _matches(_QUANTITY, "4Gi")] = "4Gi"
    ephemeral_storage: Annotated[str, _matches(_QUANTITY, "20Gi")] = "20Gi"

    @property
    def base(self) -> str:
        """The image every generated Dockerfile starts FROM."""
        return self.base_image or f"{self.registry}/{JOB_BASE}"

    def repository_for(self, team: str) -> str:
        """The repository of `team`'s images (`{team}` in BERTH_BUILD_REPOSITORY replaced)."""
        return self.repository.replace("{team}", team)

    def reference(self, digest: str, team: str) -> str:
        """`<registry>/<repository>:<tag>` of `team`'s image of the context with this digest."""
        return f"{self.registry}/{self.repository_for(team)}:{tag_for(digest)}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ImageBuildSettings:
        """The settings from BERTH_BUILD_* variables (`ENV` maps each field to its variable);
        ImageSettingsError names every bad variable with its fix."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, name in ENV.items():
            raw = env.get(name, "").strip()
            if raw:
                values[field] = _FLAGS.get(raw.lower(), raw) if field in _BOOLS else raw
        if "registry" not in values:
            raise ImageSettingsError(
                "BERTH_BUILD_REGISTRY: not set, and a job with `environment` needs an image "
                "built in the cluster; set it to the registry Berth pushes to (e.g. "
                "'registry.example.com'), or give the job an `image` instead"
            )
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                name = ENV.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else "?"
                ctx = err.get("ctx") or {}
                why = str(ctx["error"]) if "error" in ctx else err["msg"]
                lines.append(f"{name}: {why}")
            raise ImageSettingsError("\n".join(lines)) from None


ENV = {
    "registry": "BERTH_BUILD_REGISTRY",
    "repository": "BERTH_BUILD_REPOSITORY",
    "base_image": "BERTH_BUILD_BASE_IMAGE",
    "base_python": "BERTH_BUILD_BASE_PYTHON",
    "base_user": "BERTH_BUILD_BASE_USER",
    "kaniko_image": "BERTH_BUILD_KANIKO_IMAGE",
    "push_secret": "BERTH_BUILD_PUSH_SECRET",
    "auth_file": "BERTH_BUILD_REGISTRY_AUTH_FILE",
    "insecure": "BERTH_BUILD_INSECURE_REGISTRY",
    "allow_root": "BERTH_BUILD_ALLOW_ROOT",
    "namespace": "BERTH_BUILD_NAMESPACE",
    "timeout_s": "BERTH_BUILD_TIMEOUT_S",
    "cpu": "BERTH_BUILD_CPU",
    "memory": "BERTH_BUILD_MEMORY",
    "ephemeral_storage": "BERTH_BUILD_EPHEMERAL_STORAGE",
}
_BOOLS = {"insecure", "allow_root"}
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def tag_for(digest: str) -> str:
    """The image tag of a context digest ('sha256:<hex>' or bare hex)."""
    return digest.removeprefix("sha256:")[:TAG_HEX]


@dataclass(frozen=True)
class BuildContext:
    """The files of a build context (path, content), sorted, and their canonical tarball: every
    entry a regular file owned by 0:0, mode 0644, mtime 0, no user names, so that the same files
    always give the same bytes and the same digest."""

    files: tuple[tuple[str, bytes], ...]

    def tarball(self) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for path, data in sorted(self.files):
                info = tarfile.TarInfo(path)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
        return out.getvalue()

    @property
    def digest(self) -> str:
        """'sha256:<hex>' of the uncompressed canonical tarball (gzip output may differ between
        zlib builds; the tar does not)."""
        return "sha256:" + hashlib.sha256(self.tarball()).hexdigest()

    def gzipped(self) -> bytes:
        """The tarball gzipped (what Kaniko's `tar://` context reads), without a name or time in
        the gzip header."""
        out = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as gz:
            gz.write(self.tarball())
        return out.getvalue()

    def file(self, path: str) -> bytes:
        return dict(self.files)[path]


def dockerfile(base: str, user: str) -> str:
    """The generated Dockerfile: the requirements installed into the base image's Python as
    root (so they land in its site-packages, not one user's home), then the base's user back."""
    return (
        f"# Generated by Berth (recipe {RECIPE}) for a job's `environment`; the digest of this\n"
        "# context (this file, requirements.txt) names the image.\n"
        f"FROM {base}\n"
        "USER 0\n"
        "COPY requirements.txt /tmp/berth/requirements.txt\n"
        "RUN python -m pip install --no-cache-dir --disable-pip-version-check --no-input \\\n"
        "        -r /tmp/berth/requirements.txt \\\n"
        "    && rm -rf /tmp/berth\n"
        f"USER {user}\n"
    )


def environment_context(env: Environment, settings: ImageBuildSettings) -> BuildContext | None:
    """The build context of a job's `environment`, or None when it asks for nothing beyond the
    base image (no requirements): the job then runs the base itself.

    Requirements are sorted (pip resolves them together, so their order means nothing), so that
    the same set always has the same digest. BuildConfigError when the base cannot serve the
    requested Python version.
    """
    if env.python is not None and ".".join(env.python.split(".")[:2]) != settings.base_python:
        raise BuildConfigError(
            f"environment.python: {env.python} was asked for, but the build base image "
            f"({settings.base}) runs Python {settings.base_python} (BERTH_BUILD_BASE_PYTHON); "
            "leave environment.python out, or ask your admin for a base image with that version "
            "(BERTH_BUILD_BASE_IMAGE)"
        )
    if not env.requirements:
        return None
    requirements = "".join(f"{r.strip()}\n" for r in sorted(env.requirements))
    context = BuildContext(
        (
            ("Dockerfile", dockerfile(settings.base, settings.base_user).encode()),
            ("requirements.txt", requirements.encode()),
        )
    )
    if len(context.gzipped()) > CONTEXT_LIMIT:
        raise BuildConfigError(
            f"environment.requirements: the build context is over {CONTEXT_LIMIT // 1024} KiB "
            "gzipped, more than a ConfigMap carries; list fewer requirements, or build the image "
            "yourself and give `image`"
        )
    return context
