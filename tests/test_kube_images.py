"""What an `environment` job's image is (berth/runtime/kubernetes/images.py): the admin's
BERTH_BUILD_* settings, the generated build context and its digest; and how Berth asks a real
registry (go-containerregistry's, tests/oci_registry.py) whether an image exists, with no
credentials, HTTP Basic and bearer tokens (registry.py)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from oci_registry import push_image, run_registry
from pydantic import ValidationError

from berth.runtime.kubernetes.build_manifests import builder_name
from berth.runtime.kubernetes.images import (
    BuildConfigError,
    ImageBuildSettings,
    ImageSettingsError,
    environment_context,
    tag_for,
)
from berth.runtime.kubernetes.registry import (
    RegistryClient,
    RegistryError,
    credentials_for,
)
from berth.spec import Environment

SETTINGS = ImageBuildSettings(registry="registry.example.com")


def test_settings_come_from_berth_build_variables() -> None:
    got = ImageBuildSettings.from_env(
        {
            "BERTH_BUILD_REGISTRY": "registry.example.com:5000",
            "BERTH_BUILD_REPOSITORY": "ml/envs",
            "BERTH_BUILD_ALLOW_ROOT": "1",
            "BERTH_BUILD_INSECURE_REGISTRY": "false",
            "BERTH_BUILD_PUSH_SECRET": "berth-push",
            "BERTH_BUILD_TIMEOUT_S": "900",
        }
    )
    assert (got.registry, got.repository, got.allow_root, got.insecure) == (
        "registry.example.com:5000", "ml/envs", True, False,
    )  # fmt: skip
    assert got.push_secret == "berth-push" and got.timeout_s == 900
    assert got.base == "registry.example.com:5000/berth/job-base:0.1.0"  # docker/job-base
    digest = "sha256:" + "ab" * 32
    assert got.reference(digest, "vision") == f"registry.example.com:5000/ml/envs:{'ab' * 16}"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "BERTH_BUILD_REGISTRY: not set"),
        ({"BERTH_BUILD_REGISTRY": "https://r.io"}, "BERTH_BUILD_REGISTRY: must be a registry host"),
        ({"BERTH_BUILD_REGISTRY": "r.io/team"}, "put the path in BERTH_BUILD_REPOSITORY"),
        ({"BERTH_BUILD_REPOSITORY": "ML/Envs"}, "BERTH_BUILD_REPOSITORY: must be a repository"),
        ({"BERTH_BUILD_KANIKO_IMAGE": "gcr.io/kaniko-project/executor"}, "must be pinned"),
        ({"BERTH_BUILD_KANIKO_IMAGE": "gcr.io/kaniko-project/executor:latest"}, "must be pinned"),
        ({"BERTH_BUILD_BASE_IMAGE": "HTTP://x"}, "BERTH_BUILD_BASE_IMAGE: must not have a scheme"),
        ({"BERTH_BUILD_ALLOW_ROOT": "sure"}, "BERTH_BUILD_ALLOW_ROOT:"),
        ({"BERTH_BUILD_TIMEOUT_S": "-5"}, "BERTH_BUILD_TIMEOUT_S:"),
        ({"BERTH_BUILD_MEMORY": "4 GB"}, "BERTH_BUILD_MEMORY: got '4 GB'; e.g. '4Gi'"),
    ],
)
def test_a_bad_setting_names_its_variable_and_the_fix(env: dict[str, str], says: str) -> None:
    base = {"BERTH_BUILD_REGISTRY": "registry.example.com"} if env else {}
    with pytest.raises(ImageSettingsError) as err:
        ImageBuildSettings.from_env(base | env)
    assert says in str(err.value)


def test_a_pinned_builder_by_digest_is_accepted() -> None:
    digest = "sha256:" + "0" * 64
    image = f"gcr.io/kaniko-project/executor@{digest}"
    assert ImageBuildSettings(registry="r.io", kaniko_image=image).kaniko_image == image


REQUIREMENT = st.from_regex(
    r"[a-z]([a-z0-9-]{0,10}[a-z0-9])?(==[0-9]\.[0-9]{1,2})?", fullmatch=True
)


@given(st.lists(REQUIREMENT, min_size=1, max_size=6, unique=True), st.randoms())
def test_the_digest_is_the_set_of_requirements_and_the_base(reqs: list[str], rnd) -> None:
    shuffled = list(reqs)
    rnd.shuffle(shuffled)
    one = environment_context(Environment(requirements=tuple(reqs)), SETTINGS)
    two = environment_context(Environment(requirements=tuple(shuffled)), SETTINGS)
    assert one is not None and two is not None
    assert one.digest == two.digest and one.tarball() == two.tarball()
    other = SETTINGS.model_copy(update={"base_image": "registry.example.com/ml/base:2"})
    moved = environment_context(Environment(requirements=tuple(reqs)), other)
    assert moved is not None and moved.digest != one.digest
    more = environment_context(Environment(requirements=(*reqs, "zzz-extra")), SETTINGS)
    assert more is not None and more.digest != one.digest
    assert len(tag_for(one.digest)) == 32 and one.digest.startswith("sha256:" + tag_for(one.digest))


def test_the_context_is_a_canonical_tarball_of_a_dockerfile_and_the_requirements() -> None:
    ctx = environment_context(Environment(requirements=("torch==2.3.1", "einops")), SETTINGS)
    assert ctx is not None
    with tarfile.open(fileobj=io.BytesIO(ctx.tarball())) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["Dockerfile", "requirements.txt"]
        assert {(m.mode, m.mtime, m.uid, m.gid, m.uname) for m in members} == {(0o644, 0, 0, 0, "")}
    docker = ctx.file("Dockerfile").decode()
    lines = [ln for ln in docker.splitlines() if not ln.startswith("#")]
    assert lines[0] == "FROM registry.example.com/berth/job-base:0.1.0"
    assert lines[1] == "USER 0" and lines[-1] == "USER 1000:1000"
    assert "-r /tmp/berth/requirements.txt" in docker
    assert ctx.file("requirements.txt") == b"einops\ntorch==2.3.1\n"


def test_what_cannot_be_built_is_said_before_anything_runs() -> None:
    with pytest.raises(BuildConfigError, match=r"environment.python: 3.10 was asked for, but"):
        environment_context(Environment(requirements=("x",), python="3.10"), SETTINGS)
    assert environment_context(Environment(requirements=("x",), python="3.11.9"), SETTINGS)
    # Nothing to install: the base image is the environment, no build.
    assert environment_context(Environment(python="3.11"), SETTINGS) is None
    # Names that do not compress away: over the ConfigMap's cap even gzipped.
    many = tuple(f"p{hashlib.sha256(str(i).encode()).hexdigest()}=={i}.0" for i in range(40_000))
    with pytest.raises(BuildConfigError, match="more than a ConfigMap carries"):
        environment_context(Environment(requirements=many), SETTINGS)


# --- the registry, for real ---------------------------------------------------------------------


@pytest.mark.parametrize("auth", ["none", "basic", "bearer"])
def test_the_registry_says_whether_an_image_is_there(auth: str, tmp_path: Path) -> None:
    with run_registry(tmp_path, auth) as reg:
        pushed = push_image(reg, "berth/envs", "abc123")
        login = credentials_for(reg.host, reg.docker_config(tmp_path / "config.json"))
        ask = RegistryClient(reg.host, insecure=True, credentials=login)
        assert ask.manifest_digest("berth/envs", "abc123") == pushed
        assert ask.manifest_digest("berth/envs", "not-there") is None
        assert ask.manifest_digest("berth/other", "abc123") is None
        if auth == "none":
            return
        anonymous = RegistryClient(reg.host, insecure=True)
        with pytest.raises(RegistryError, match="asks for credentials and none are configured"):
            anonymous.manifest_digest("berth/envs", "abc123")
        wrong = credentials_for(reg.host, reg.docker_config(tmp_path / "bad.json", "nope"))
        with pytest.raises(RegistryError, match=r"BERTH_BUILD_REGISTRY_AUTH_FILE: .*refused"):
            RegistryClient(reg.host, insecure=True, credentials=wrong).manifest_digest(
                "berth/envs", "abc123"
            )


def test_an_unreachable_registry_names_the_settings(tmp_path: Path) -> None:
    with run_registry(tmp_path) as reg:
        host = reg.host
        https = RegistryClient(host)  # TLS to a plain-HTTP registry
        with pytest.raises(RegistryError, match=r"over HTTPS .*BERTH_BUILD_INSECURE_REGISTRY"):
            https.manifest_digest("berth/envs", "x")
    gone = RegistryClient(host, insecure=True, timeout_s=5)  # the registry has stopped
    with pytest.raises(RegistryError, match=f"BERTH_BUILD_REGISTRY: {host} cannot be reached"):
        gone.manifest_digest("berth/envs", "x")


def test_credentials_come_from_a_docker_config(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "auths": {
                    "https://r.example.com/v1/": {"username": "u", "password": "p:w"},
                    "other.io": {"auth": "bm86cGU="},  # 'no:pe'
                }
            }
        )
    )
    assert credentials_for("r.example.com", config).password == "p:w"
    assert credentials_for("other.io", config).username == "no"
    assert credentials_for("third.io", config) is None
    assert credentials_for("r.example.com", None) is None
    config.write_text("{not json")
    with pytest.raises(RegistryError, match=r"BERTH_BUILD_REGISTRY_AUTH_FILE .*cannot be read"):
        credentials_for("r.example.com", config)


def test_one_repository_per_team_keeps_teams_images_and_builds_apart() -> None:
    shared = ImageBuildSettings(registry="r.example.com")
    per_team = ImageBuildSettings(registry="r.example.com", repository="berth/{team}/envs")
    digest = "sha256:" + "cd" * 32
    assert shared.reference(digest, "vision") == shared.reference(digest, "language")
    assert per_team.reference(digest, "vision") == f"r.example.com/berth/vision/envs:{'cd' * 16}"
    assert per_team.repository_for("language") == "berth/language/envs"
    # One builder pod per destination: per team only when each team has its repository.
    assert builder_name(digest) == f"berth-build-{'cd' * 16}"
    names = {builder_name(digest, team) for team in ("vision", "language")}
    assert len(names) == 2 and all(len(n) <= 63 for n in names)
    with pytest.raises(ValidationError, match="one repository per team"):
        ImageBuildSettings(registry="r.example.com", repository="berth/{Team}/envs")
