"""Whether an image is already in the registry: the OCI distribution API's manifest HEAD.

`HEAD /v2/<repository>/manifests/<tag>` answers 200 with the manifest's digest
(`Docker-Content-Digest`) when the image exists and 404 when it does not; nothing is downloaded.
A registry that wants credentials answers 401 with a challenge, and this client follows the two
kinds registries use: `Basic` (Distribution with htpasswd) and `Bearer` (a token realm that
hands out a token for Basic credentials or anonymously: Docker Hub, GHCR, Harbor, Artifact
Registry, ECR's OCI endpoint). Credentials come from a docker config.json (its `auths`), the
same format as the Secret that Kaniko pushes with. Credential helpers (`credsStore`,
`credHelpers`) are not run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)
_PARAM = re.compile(r'(\w+)="([^"]*)"')


class RegistryError(RuntimeError):
    """The registry could not be asked, or refused; the message names the setting to check."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def basic(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


def _host(key: str) -> str:
    """A docker config `auths` key as a bare host[:port] ('https://r.io/v1/' -> 'r.io')."""
    return re.sub(r"^[a-z]+://", "", key).split("/", 1)[0]


def credentials_for(registry: str, auth_file: Path | None) -> Credentials | None:
    """The registry's credentials in a docker config.json (`auths`), or None when the file is
    not given or has none for it. RegistryError (naming the setting) for an unreadable file."""
    if auth_file is None:
        return None
    where = f"BERTH_BUILD_REGISTRY_AUTH_FILE ({auth_file})"
    try:
        auths = json.loads(auth_file.read_text()).get("auths") or {}
    except (OSError, ValueError, AttributeError) as e:
        raise RegistryError(
            f"{where}: cannot be read as a docker config.json ({e}); point it at a file like "
            "the .dockerconfigjson of a kubernetes.io/dockerconfigjson Secret"
        ) from None
    entry = next((v for k, v in auths.items() if _host(k) == registry), None)
    if not isinstance(entry, dict):
        return None
    if entry.get("username") is not None and entry.get("password") is not None:
        return Credentials(str(entry["username"]), str(entry["password"]))
    try:
        user, _, password = base64.b64decode(entry.get("auth", "")).decode().partition(":")
    except ValueError:
        user = password = ""
    if not user:
        raise RegistryError(
            f"{where}: the entry for {registry} has no username and password (nor an `auth` of "
            "base64 'user:password'); an identity token or a credential helper is not supported"
        )
    return Credentials(user, password)


class RegistryClient:
    """Asks one registry about manifests; see the module docstring. `transport` is httpx's
    (tests may pass one; by default a real connection)."""

    def __init__(
        self,
        registry: str,
        *,
        insecure: bool = False,
        credentials: Credentials | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.registry = registry
        self.base = f"{'http' if insecure else 'https'}://{registry}"
        self.credentials = credentials
        self._http = httpx.Client(timeout=timeout_s, transport=transport)
        self._authorization: dict[str, str] = {}  # per repository: a token or Basic

    def close(self) -> None:
        self._http.close()

    def manifest_digest(self, repository: str, reference: str) -> str | None:
        """The digest ('sha256:...') of `repository:reference`'s manifest, or None when the
        registry has no such manifest (or no such repository)."""
        url = f"{self.base}/v2/{repository}/manifests/{reference}"
        response = self._request("HEAD", url, repository)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise RegistryError(
                f"BERTH_BUILD_REGISTRY: HEAD {url} answered HTTP {response.status_code}; check "
                "the registry and the repository (BERTH_BUILD_REPOSITORY)"
            )
        digest = response.headers.get("Docker-Content-Digest")
        if digest:
            return digest
        body = self._request("GET", url, repository).content  # a registry without the header
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def _request(self, method: str, url: str, repository: str) -> httpx.Response:
        headers = {"Accept": MANIFEST_TYPES}
        if repository in self._authorization:
            headers["Authorization"] = self._authorization[repository]
        response = self._send(method, url, headers)
        if response.status_code != 401:
            return response
        challenge = response.headers.get("WWW-Authenticate", "")
        answer = self._authorization[repository] = self._answer(challenge, repository)
        response = self._send(method, url, headers | {"Authorization": answer})
        if response.status_code in (401, 403):
            raise RegistryError(
                f"BERTH_BUILD_REGISTRY_AUTH_FILE: {self.registry} refused the credentials "
                f"{self._whose()} for {repository} (HTTP {response.status_code}); give a "
                "docker config.json whose `auths` entry for it may pull and push there"
            )
        return response

    def _send(self, method: str, url: str, headers: dict[str, str]) -> httpx.Response:
        try:
            return self._http.request(method, url, headers=headers)
        except httpx.HTTPError as e:
            plain = "plain HTTP" if self.base.startswith("http:") else "HTTPS"
            raise RegistryError(
                f"BERTH_BUILD_REGISTRY: {self.registry} cannot be reached over {plain} "
                f"({type(e).__name__}: {e}); check the host and port, and "
                "BERTH_BUILD_INSECURE_REGISTRY (only a registry without TLS needs it)"
            ) from None

    def _answer(self, challenge: str, repository: str) -> str:
        """The Authorization header that answers a 401's challenge."""
        scheme = challenge.split(" ", 1)[0].lower()
        if scheme == "basic":
            if self.credentials is None:
                raise self._needs_credentials()
            return self.credentials.basic()
        if scheme != "bearer":
            raise RegistryError(
                f"BERTH_BUILD_REGISTRY: {self.registry} asks for authentication Berth does not "
                f"speak ({challenge!r}); only Basic and Bearer token challenges are followed"
            )
        params = dict(_PARAM.findall(challenge))
        realm = params.pop("realm", "")
        if not realm:
            raise RegistryError(f"{self.registry}: a Bearer challenge without realm: {challenge!r}")
        query = {"service": params.get("service", "")} if params.get("service") else {}
        query["scope"] = f"repository:{repository}:pull"
        auth = {"Authorization": self.credentials.basic()} if self.credentials else {}
        try:
            got = self._http.get(realm, params=query, headers=auth)
        except httpx.HTTPError as e:
            raise RegistryError(
                f"BERTH_BUILD_REGISTRY: the token service {realm} of {self.registry} cannot be "
                f"reached ({type(e).__name__}: {e})"
            ) from None
        if got.status_code in (401, 403):
            raise (
                self._needs_credentials()
                if self.credentials is None
                else RegistryError(
                    f"BERTH_BUILD_REGISTRY_AUTH_FILE: the token service of {self.registry} refused "
                    f"{self._whose()} (HTTP {got.status_code}); check the username and password"
                )
            )
        token = _token(got)
        if not token:
            raise RegistryError(
                f"BERTH_BUILD_REGISTRY: the token service {realm} answered HTTP "
                f"{got.status_code} without a token"
            )
        return f"Bearer {token}"

    def _needs_credentials(self) -> RegistryError:
        return RegistryError(
            f"BERTH_BUILD_REGISTRY_AUTH_FILE: {self.registry} asks for credentials and none are "
            "configured; set it to a docker config.json with an `auths` entry for the registry "
            "(e.g. the push Secret's .dockerconfigjson, mounted into Berth's workers)"
        )

    def _whose(self) -> str:
        return f"of user {self.credentials.username!r}" if self.credentials else "(anonymous)"


def _token(response: httpx.Response) -> str | None:
    if response.status_code != 200:
        return None
    try:
        data: Any = response.json()
    except ValueError:
        return None
    return (data.get("token") or data.get("access_token")) if isinstance(data, dict) else None
