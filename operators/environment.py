"""The job's Python environment on the embedded default: a virtualenv per set of requirements.

A job that gives `environment.requirements` runs in `$BERTH_HOME/envs/<hash>`, where the hash
covers the requirements and the Python version, so jobs that ask for the same packages share one
environment and a changed list gets a new one. A file lock per hash makes two tasks that ask at
the same moment build it once: the second waits, then finds it ready (`.berth-env.json` is
written last, so a half-built folder is never taken for a ready one and is rebuilt).

The virtualenv is layered on the platform's environment (a `.pth` file adds the platform's
site-packages after the venv's own), when it uses the same Python: requirements the platform
already satisfies (numpy, say) are neither downloaded nor copied, which keeps the embedded
default fast and usable offline, and a requirement at another version is installed into the venv,
whose own site-packages come first. A job that gives an `image` runs in the platform's
interpreter, with a warning: the embedded default has no container runtime.

On Kubernetes (`prepare_image`) the environment is an image instead: built in the cluster from
a generated build context, or found in the registry when an image of the same context is there
(berth/runtime/kubernetes/build.py); a job that gives `image` runs that image. The run task
launches what `PreparedImage.image` names (`spec_for_launch`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from berth.spec import JobSpec

if TYPE_CHECKING:  # the kubernetes client loads only on the Kubernetes runtime
    from berth.runtime.kubernetes.build import ImageBuilder

log = logging.getLogger(__name__)
READY = ".berth-env.json"


class EnvironmentBuildError(RuntimeError):
    """The job's environment could not be built; the message names the field and the fix."""


@dataclass(frozen=True, slots=True)
class PreparedEnv:
    """Where the job's `python` lives: `bin_dir` goes first on the replicas' PATH."""

    kind: str  # venv | platform
    python: str
    bin_dir: str
    key: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {"kind": self.kind, "python": self.python, "bin_dir": self.bin_dir, "key": self.key}


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """What the job's replicas run on Kubernetes: `image` (pinned by digest when Berth built or
    found it), and where it came from: the spec, the build base (an `environment` with no
    requirements), the registry (`present`), or a build (`built`, or `joined`: another job's)."""

    image: str
    source: str  # spec | base | present | built | joined
    digest: str | None = None
    context_digest: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {
            "kind": "image",
            "image": self.image,
            "source": self.source,
            "digest": self.digest,
            "context_digest": self.context_digest,
        }


def prepare_image(
    spec: JobSpec,
    builder: ImageBuilder | None,
    *,
    requested_by: Mapping[str, str] | None = None,
    logger: logging.Logger | None = None,
) -> PreparedImage:
    """The image the job's replicas run on Kubernetes, built in the cluster if needed.

    `builder` may be None for a job that gives `image` (nothing to build). Raises the builder's
    BuildError, or BuildConfigError for an environment the settings cannot build.
    """
    if spec.environment is None:
        assert spec.image is not None  # the spec has exactly one of the two
        return PreparedImage(spec.image, "spec")
    if builder is None:
        raise ValueError("an `environment` job needs an image builder (settings().image_builder())")
    from berth.runtime.kubernetes.images import environment_context

    context = environment_context(spec.environment, builder.settings)
    if context is None:  # nothing to install: the base image is the environment
        return PreparedImage(builder.settings.base, "base")
    result = builder.ensure(context, spec.team, requested_by=requested_by, logger=logger)
    return PreparedImage(result.pinned, result.outcome, result.digest, context.digest)


def spec_for_launch(spec: JobSpec, prepared: Mapping[str, Any]) -> JobSpec:
    """The spec the Kubernetes runtime launches: the prepared image (the prepare step's XCom,
    `PreparedImage.to_dict()`) in place of `environment`."""
    if prepared.get("kind") != "image" or not prepared.get("image"):
        raise ValueError(
            f"prepared environment: expected an image (the Kubernetes runtime's prepare step), "
            f"got {dict(prepared)!r}; run prepare_env with BERTH_RUNTIME=kubernetes"
        )
    return spec.model_copy(update={"image": str(prepared["image"]), "environment": None})


def env_key(requirements: tuple[str, ...], python: str | None) -> str:
    """Same requirements (in any order) and Python version -> same environment."""
    text = json.dumps({"requirements": sorted(requirements), "python": python or ""})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_environment(spec: JobSpec, envs_dir: Path, *, timeout_s: float = 1800) -> PreparedEnv:
    """The environment the job's replicas run in, built if needed (see the module docstring)."""
    if spec.environment is None:
        log.warning(
            "image %s: the embedded default has no container runtime; the job runs in the "
            "platform's Python environment (%s). Use the Kubernetes runtime to run images.",
            spec.image,
            sys.prefix,
        )
        return PreparedEnv("platform", sys.executable, str(Path(sys.executable).parent))
    reqs, version = spec.environment.requirements, spec.environment.python
    key = env_key(reqs, version)
    target = envs_dir / key
    envs_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(envs_dir / f"{key}.lock"), timeout=timeout_s):
        if not (target / READY).exists():
            _build(target, reqs, _base_python(version), timeout_s)
    return PreparedEnv("venv", str(target / "bin" / "python"), str(target / "bin"), key)


def _base_python(version: str | None) -> str:
    """The interpreter to build from: this one, or `python<version>` found on PATH."""
    current = f"{sys.version_info.major}.{sys.version_info.minor}"
    if version is None or version in (current, f"{current}.{sys.version_info.micro}"):
        return sys.executable
    found = shutil.which(f"python{'.'.join(version.split('.')[:2])}")
    if found is None:
        raise EnvironmentBuildError(
            f"environment.python: Python {version} is not installed on this machine (the "
            f"platform runs {current}); install it, or leave environment.python out"
        )
    return found


def _build(target: Path, reqs: tuple[str, ...], base: str, timeout_s: float) -> None:
    started = time.monotonic()
    if target.exists():  # a build that died half-way
        shutil.rmtree(target)
    _run([base, "-m", "venv", "--without-pip", str(target)], "creating the virtualenv", timeout_s)
    python = target / "bin" / "python"
    if base == sys.executable:
        purelib = _site_packages(python)
        platform = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        (Path(purelib) / "_berth_platform.pth").write_text("\n".join(sorted(platform)) + "\n")
    if reqs:
        # pip of the platform installs into the venv (`--python`), so the venv needs no pip.
        cmd = [sys.executable, "-m", "pip", "--python", str(python), "install"]
        cmd += ["--disable-pip-version-check", "--no-input", "-q", *reqs]
        _run(cmd, f"installing environment.requirements {list(reqs)}", timeout_s)
    info = {"requirements": list(reqs), "python": base, "build_s": time.monotonic() - started}
    (target / READY).write_text(json.dumps(info))
    log.info("built environment %s in %.1f s", target, info["build_s"])


def _site_packages(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _run(cmd: list[str], what: str, timeout_s: float) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildError(f"environment: {what} took over {timeout_s:g} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise EnvironmentBuildError(
            f"environment.requirements: {what} failed (exit {done.returncode}); check the "
            f"package names and versions:\n{tail}"
        )
