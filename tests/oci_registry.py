"""A real OCI registry for the tests: go-containerregistry's in-memory registry, built from Go
modules by `scripts/build-registry.sh` (tools/registry/, cached), run on a free loopback port.

`run_registry(auth=...)` starts one with no authentication, HTTP Basic, or a bearer token realm
(tools/registry/main.go puts those in front of the upstream registry); `push_image` pushes a
small image (a layer, a config, an OCI manifest) through the distribution API, as any client
pushes. When the binary is not built the tests skip, saying how to build it; with
BERTH_REQUIRE_KUBE=1 (CI) they fail instead.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from go_binaries import cached_binary, required_version
from ports import free_port

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools" / "registry"
MODULE = "github.com/google/go-containerregistry"
START_DEADLINE_S = 30.0
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def registry_version(go_mod: Path = TOOLS / "go.mod") -> str:
    """The go-containerregistry version that tools/registry/go.mod requires."""
    return required_version(go_mod, MODULE)


def registry_path(tools: Path = TOOLS) -> Path:
    """Where scripts/build-registry.sh caches the binary (the same rule, kept in step)."""
    return cached_binary(tools, MODULE, "BERTH_REGISTRY_CACHE", "registry", "registry")


@dataclass
class Registry:
    """A running registry: its host:port, and the one user it accepts (when it asks)."""

    host: str
    auth: str  # none | basic | bearer
    user: str = "berth-push"
    password: str = "s3cret-push"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def authorization(self) -> dict[str, str]:
        """The header a client with the right credentials sends."""
        basic = "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        if self.auth == "none":
            return {}
        if self.auth == "basic":
            return {"Authorization": basic}
        token = httpx.get(f"{self.url}/token", headers={"Authorization": basic}).json()["token"]
        return {"Authorization": f"Bearer {token}"}

    def docker_config(self, path: Path, password: str | None = None) -> Path:
        """A docker config.json with this registry's login (the push Secret's format)."""
        login = f"{self.user}:{password or self.password}".encode()
        auths = {self.host: {"auth": base64.b64encode(login).decode()}}
        path.write_text(json.dumps({"auths": auths}))
        return path


@contextmanager
def run_registry(workdir: Path, auth: str = "none") -> Iterator[Registry]:
    """A registry process until the block ends (skips or fails when it is not built)."""
    binary = registry_path()
    if not binary.is_file():
        why = f"the OCI registry is not built at {binary}"
        if os.environ.get("BERTH_REQUIRE_KUBE") == "1":
            pytest.fail(f"an OCI registry is required (BERTH_REQUIRE_KUBE=1) but {why}")
        pytest.skip(f"{why}; run scripts/build-registry.sh")
    registry = Registry(f"127.0.0.1:{free_port()}", auth)
    argv = [str(binary), f"-addr={registry.host}", f"-auth={auth}"]
    if auth != "none":
        argv += [f"-user={registry.user}", f"-password={registry.password}"]
    log = workdir / f"registry-{auth}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the registry exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{registry.url}/v2/", timeout=2).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the registry did not answer in {START_DEADLINE_S:.0f} s")
            time.sleep(0.1)  # polling a real process that is starting
        yield registry
    finally:
        proc.terminate()
        proc.wait(10)


def _blob(client: httpx.Client, registry: Registry, repository: str, data: bytes) -> dict:
    """Upload one blob (POST, then a monolithic PUT with its digest); its descriptor."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    started = client.post(f"{registry.url}/v2/{repository}/blobs/uploads/")
    assert started.status_code == 202, started.text
    location = httpx.URL(registry.url).join(started.headers["Location"])
    done = client.put(
        location.copy_merge_params({"digest": digest}),
        content=data,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert done.status_code == 201, done.text
    return {"digest": digest, "size": len(data)}


def push_image(registry: Registry, repository: str, tag: str, note: str = "berth") -> str:
    """Push a one-layer image (a file holding `note`) as `repository:tag`; its manifest digest."""
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w") as tar:
        data = note.encode()
        info = tarfile.TarInfo("etc/berth-note")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    layer = gzip.compress(layer_tar.getvalue(), mtime=0)
    diff_id = "sha256:" + hashlib.sha256(layer_tar.getvalue()).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    with httpx.Client(headers=registry.authorization(), timeout=30) as client:
        config_desc = _blob(client, registry, repository, config)
        layer_desc = _blob(client, registry, repository, layer)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
                "layers": [
                    {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer_desc}
                ],
            }
        ).encode()
        put = client.put(
            f"{registry.url}/v2/{repository}/manifests/{tag}",
            content=manifest,
            headers={"Content-Type": OCI_MANIFEST},
        )
    assert put.status_code == 201, put.text
    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    assert put.headers["Docker-Content-Digest"] == digest
    return digest
