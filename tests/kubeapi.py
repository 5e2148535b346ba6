"""A real Kubernetes API server for the tests (import `kube_api` into a test module).

etcd (Debian's etcd-server) and kube-apiserver (built from the Kubernetes Go modules by
`scripts/build-kube.sh`, cached) run on free loopback ports with a temporary data dir, once per
test session. There is no kubelet, scheduler or controller manager: pods move through their
phases only when `kubelet_standin` moves them, and a namespace gets its `default`
ServiceAccount only from `KubeAPI.create_namespace` (the controller manager's job elsewhere).

Authentication is real: a static token file holds an admin (system:masters) and a user with no
rights at all; ServiceAccount tokens come from the TokenRequest API, signed with a key pair
made here. Authorization is RBAC only, so a test can check what a least-privilege identity may
and may not do.

Dynamic Resource Allocation needs no flag: v1.35 serves resource.k8s.io/v1 by default (GA
since 1.34, its beta versions off). `run_kube_api(..., extra_args)` starts a server with other
flags, e.g. `--runtime-config=resource.k8s.io/v1=false` for a cluster without DRA.

When the binaries are not built the tests skip, saying how to build them; with
BERTH_REQUIRE_KUBE=1 (CI, after scripts/build-kube.sh) they fail instead.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import itertools
import os
import secrets
import shutil
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from go_binaries import cached_binary, required_version
from kubernetes import client
from ports import free_port
from waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools" / "kube"
START_DEADLINE_S = 180.0  # a cold start on a busy 2-core machine takes tens of seconds
STOP_DEADLINE_S = 20.0
ADMIN_USER = "berth-test-admin"
NOBODY_USER = "berth-test-nobody"


def kube_version(go_mod: Path = TOOLS / "go.mod") -> str:
    """The k8s.io/kubernetes version that tools/kube/go.mod requires."""
    return required_version(go_mod, "k8s.io/kubernetes")


def kube_apiserver_path(tools: Path = TOOLS) -> Path:
    """Where scripts/build-kube.sh caches kube-apiserver (the same rule, kept in step)."""
    return cached_binary(tools, "k8s.io/kubernetes", "BERTH_KUBE_CACHE", "kube", "kube-apiserver")


def unavailable(why: str) -> None:
    """Skip (a developer without the binaries) or fail (BERTH_REQUIRE_KUBE=1, as in CI)."""
    if os.environ.get("BERTH_REQUIRE_KUBE") == "1":
        pytest.fail(f"a Kubernetes API server is required (BERTH_REQUIRE_KUBE=1) but {why}")
    pytest.skip(f"no Kubernetes API server: {why}; run scripts/build-kube.sh")


def create_once(create: Callable[..., Any], *args: Any) -> None:
    """`create(*args)` for a cluster-wide object the session's tests share (a DeviceClass, a
    PriorityClass): the first test creates it, a later one meets 409 (it exists), which is fine."""
    try:
        create(*args)
    except client.ApiException as e:
        if e.status != 409:
            raise


@dataclass
class KubeAPI:
    """A running API server and what a test needs to talk to it as anyone."""

    host: str
    ca_file: Path
    admin_token: str
    nobody_token: str  # authenticated, but RBAC grants it nothing
    version: str
    workdir: Path
    admin: client.ApiClient = field(init=False)
    _clients: list[client.ApiClient] = field(default_factory=list, repr=False)
    _names: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _restart: Callable[[float], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.admin = self.client(self.admin_token)

    def restart_server(self, down_s: float = 0.0) -> None:
        """Stop kube-apiserver, leave it down `down_s`, start it again on the same port and
        etcd, and return once it is ready (an upgrade or a crash, as clients see it)."""
        assert self._restart is not None, "a server of run_kube_api's own"
        self._restart(down_s)

    def client(self, token: str) -> client.ApiClient:
        """An API client that authenticates with a bearer token."""
        conf = client.Configuration(host=self.host)
        conf.ssl_ca_cert = str(self.ca_file)
        conf.api_key = {"BearerToken": token}
        conf.api_key_prefix = {"BearerToken": "Bearer"}
        api = client.ApiClient(conf)
        self._clients.append(api)
        return api

    @property
    def core(self) -> client.CoreV1Api:
        """CoreV1Api as the admin."""
        return client.CoreV1Api(self.admin)

    def unique_name(self, prefix: str) -> str:
        """A DNS-1123 name no other test of this session uses (the server is shared)."""
        return f"{prefix}-{next(self._names)}-{secrets.token_hex(2)}"

    def create_namespace(self, prefix: str = "t") -> str:
        """A new namespace with its `default` ServiceAccount, which pods need to be admitted
        (the controller manager would create it; this server has none)."""
        name = self.unique_name(prefix)
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        self.create_service_account(name, "default")
        return name

    def create_service_account(self, namespace: str, name: str) -> None:
        self.core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))
        )

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A token for a ServiceAccount from the TokenRequest API, as a pod would get one."""
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=seconds)
        )
        done = self.core.create_namespaced_service_account_token(name, namespace, request)
        return done.status.token

    def service_account_client(self, namespace: str, name: str) -> client.ApiClient:
        """An API client acting as a ServiceAccount (which must exist)."""
        return self.client(self.service_account_token(namespace, name))

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """A kubeconfig for this server (admin unless `token`), for code that reads one."""
        cluster = {"server": self.host, "certificate-authority": str(self.ca_file)}
        user, ctx = {"token": token or self.admin_token}, {"cluster": "test", "user": "test"}
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": "test", "user": user}],
            "contexts": [{"name": "test", "context": ctx}],
        }  # fmt: skip
        path.write_text(yaml.safe_dump(config))
        return path

    def close(self) -> None:
        for api in self._clients:
            api.close()


# --- certificates and keys -------------------------------------------------------------------


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    pkcs8, clear = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, pkcs8, clear)


def _cert(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, Any] | None = None
) -> x509.Certificate:
    """A CA certificate when `issuer` is None (self-signed), else a serving certificate for
    127.0.0.1 and localhost signed by the issuer (its name and key)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer or (name, key)
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )  # fmt: skip
    if issuer is None:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        return builder.add_extension(usage, critical=True).sign(key, hashes.SHA256())
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    builder = builder.add_extension(x509.ExtendedKeyUsage([x509.OID_SERVER_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_credentials(workdir: Path) -> dict[str, Path | str]:
    """A CA and a serving cert for 127.0.0.1, the ServiceAccount signing key pair, and a static
    token file with the admin and the no-rights user."""
    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _cert("berth-test-ca", ca_key)
    serving_key = ec.generate_private_key(ec.SECP256R1())
    serving = _cert("kube-apiserver", serving_key, (ca_cert.subject, ca_key))
    sa_key = ec.generate_private_key(ec.SECP256R1())
    files = {
        "ca": (workdir / "ca.pem", ca_cert.public_bytes(pem)),
        "tls_cert": (workdir / "serving.pem", serving.public_bytes(pem)),
        "tls_key": (workdir / "serving-key.pem", _pem_key(serving_key)),
        "sa_key": (workdir / "sa-key.pem", _pem_key(sa_key)),
        "sa_pub": (
            workdir / "sa.pub",
            sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
        ),
    }
    out: dict[str, Path | str] = {}
    for what, (path, data) in files.items():
        path.write_bytes(data)
        path.chmod(0o600)
        out[what] = path
    admin, nobody = secrets.token_hex(24), secrets.token_hex(24)
    tokens = workdir / "tokens.csv"
    # token,user,uid,"groups"
    tokens.write_text(
        f'{admin},{ADMIN_USER},uid-admin,"system:masters"\n{nobody},{NOBODY_USER},uid-nobody\n'
    )
    tokens.chmod(0o600)
    out.update(tokens=tokens, admin_token=admin, nobody_token=nobody)
    return out


# --- processes -------------------------------------------------------------------------------


class _Process:
    """A server process with its output in a log file, stopped at teardown."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def tail(self, chars: int = 3000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-chars:]

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            pytest.fail(f"{self.name} exited with {code} while starting:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_DEADLINE_S)


def _wait_until_ok(
    proc: _Process, url: str, context: ssl.SSLContext | None = None, token: str = ""
) -> None:
    """Poll `url` until it answers 200; fail at once if the process dies, and with the last
    error and the process's log if it is not ready within START_DEADLINE_S."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    last = "no answer yet"

    def ready() -> bool:
        nonlocal last
        proc.check_alive()
        try:
            resp = httpx.get(url, headers=headers, timeout=5, verify=context or True)
        except httpx.HTTPError as e:
            last = repr(e)
            return False
        if resp.status_code != 200:
            last = f"HTTP {resp.status_code}: {resp.text[:500]}"
        return resp.status_code == 200

    what = f"{proc.name} ready at {url}"  # polled every 0.25 s: a real process that is starting
    wait_for(ready, what, START_DEADLINE_S, 0.25, detail=lambda: f"{last}\n{proc.tail()}")


def _start_etcd(etcd: str, workdir: Path) -> tuple[_Process, str]:
    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    argv = [
        etcd, "--name=berth-test", f"--data-dir={workdir / 'etcd'}",
        f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=berth-test={peer_url}", "--logger=zap", "--log-level=warn",
    ]  # fmt: skip
    proc = _Process("etcd", argv, workdir / "etcd.log")
    _wait_until_ok(proc, f"{client_url}/health")
    return proc, client_url


def _apiserver_argv(
    binary: Path, etcd_url: str, port: int, creds: dict[str, Path | str], workdir: Path
) -> list[str]:
    return [
        str(binary), f"--etcd-servers={etcd_url}", f"--secure-port={port}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
        f"--cert-dir={workdir / 'certs'}",
        f"--tls-cert-file={creds['tls_cert']}", f"--tls-private-key-file={creds['tls_key']}",
        f"--token-auth-file={creds['tokens']}", "--authorization-mode=RBAC",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={creds['sa_pub']}",
        f"--service-account-signing-key-file={creds['sa_key']}",
        "--service-cluster-ip-range=10.96.0.0/24",  # addresses only allocated, never used
        # No endpoints for the `kubernetes` Service: its address would be loopback, which
        # Endpoints reject, and nothing here reaches the API through the Service.
        "--endpoint-reconciler-type=none",
        # Fewer moving parts on a shared 2-core machine; nothing here tests fairness.
        "--enable-priority-and-fairness=false", "--profiling=false",
        # Watch lists need etcd's RequestWatchProgress, which Debian's etcd 3.4 lacks: with the
        # gate on, the server answers a Go client's (KWOK's) informer watches with an error
        # and it falls back by backing off, seeing new pods tens of seconds late.
        "--feature-gates=WatchList=false",
    ]  # fmt: skip


@contextmanager
def run_kube_api(workdir: Path, extra_args: Sequence[str] = ()) -> Iterator[KubeAPI]:
    """etcd and kube-apiserver (with `extra_args`) in `workdir` until the block ends (skips or
    fails when the binaries are missing: see `unavailable`)."""
    binary = kube_apiserver_path()
    etcd = shutil.which("etcd")
    if not binary.is_file():
        unavailable(f"kube-apiserver is not built at {binary}")
    if etcd is None:
        unavailable("etcd is not on PATH (Debian's etcd-server)")
    creds = write_credentials(workdir)
    processes: list[_Process] = []
    api: KubeAPI | None = None
    try:
        etcd_proc, etcd_url = _start_etcd(etcd, workdir)
        processes.append(etcd_proc)
        port = free_port()
        argv = [*_apiserver_argv(binary, etcd_url, port, creds, workdir), *extra_args]
        host = f"https://127.0.0.1:{port}"
        context = ssl.create_default_context(cafile=str(creds["ca"]))

        def start(log: str) -> None:
            server = _Process("kube-apiserver", argv, workdir / log)
            processes.append(server)
            _wait_until_ok(server, f"{host}/readyz", context, str(creds["admin_token"]))

        def restart(down_s: float) -> None:
            processes.pop().stop()  # the server is the last process started
            time.sleep(down_s)  # the outage itself, as clients see it
            start(f"kube-apiserver-{len(processes)}.log")

        start("kube-apiserver.log")
        api = KubeAPI(
            host=host,
            ca_file=Path(creds["ca"]),
            admin_token=str(creds["admin_token"]),
            nobody_token=str(creds["nobody_token"]),
            version=kube_version(),
            workdir=workdir,
            _restart=restart,
        )
        yield api
    finally:
        if api is not None:
            api.close()
        for proc in reversed(processes):
            proc.stop()
        shutil.rmtree(workdir / "etcd", ignore_errors=True)


class _Shared:
    """The session's one server. Each test module that imports `kube_api` gets its own fixture
    in pytest's eyes (fixtures belong to the module that holds them), so without this two
    modules would start two servers; the last user to finish stops it."""

    stack: ExitStack | None = None
    api: KubeAPI | None = None
    users = 0


@pytest.fixture(scope="session")
def kube_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    """A real kube-apiserver with etcd for the whole session, torn down at its end."""
    if _Shared.api is None:
        with ExitStack() as stack:
            _Shared.api = stack.enter_context(run_kube_api(tmp_path_factory.mktemp("kube")))
            _Shared.stack = stack.pop_all()  # started: keep it running past this block
    _Shared.users += 1
    try:
        yield _Shared.api
    finally:
        _Shared.users -= 1
        if _Shared.users == 0 and _Shared.stack is not None:
            _Shared.stack.close()
            _Shared.stack, _Shared.api = None, None
