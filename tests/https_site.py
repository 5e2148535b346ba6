"""A real HTTPS server for the staging tests: http.server with TLS and a certificate generated
here, serving what a `Site` holds and counting the requests it gets (to prove reuse on the
server side). `https_fixture` is the module-scoped `https` fixture, (site, base URL, CA file);
`trust_fixture` is `trust`, which trusts its certificate as an operator trusts a private CA."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class Site:
    """What the HTTPS server serves: path -> (body, headers), and a count of requests."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.requests: list[tuple[str, str]] = []
        self.no_head: set[str] = set()  # paths that answer HEAD with 405, as presigned URLs do
        self.errors: dict[str, int] = {}  # paths that answer with this HTTP error status
        self.lock = threading.Lock()

    def count(self, method: str, path: str) -> int:
        with self.lock:
            return self.requests.count((method, path))


def _handler(site: Site) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: bool) -> None:
            with site.lock:
                site.requests.append((self.command, self.path))
            if self.path in site.errors:
                self.send_error(site.errors[self.path])
                return
            if self.path not in site.files:
                self.send_error(404)
                return
            data, headers = site.files[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self) -> None:
            if self.path in site.no_head:
                with site.lock:
                    site.requests.append((self.command, self.path))
                self.send_error(405)
                return
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def log_message(self, *args: object) -> None:  # keep the test output clean
            pass

    return Handler


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (cert, key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module", name="https")
def https_fixture(tmp_path_factory: pytest.TempPathFactory):
    """A real HTTPS server in a thread; yields (site, base URL, CA file)."""
    cert, key = _certificate(tmp_path_factory.mktemp("tls"))
    site = Site()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(site))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield site, f"https://127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(name="trust")
def trust_fixture(https, monkeypatch: pytest.MonkeyPatch):
    """Trust the test server's certificate, the way an operator trusts a private CA."""
    monkeypatch.setenv("SSL_CERT_FILE", str(https[2]))
    return https[:2]
