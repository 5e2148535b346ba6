"""A real S3 endpoint for tests: moto's threaded server over HTTP on a free port.

Nothing is patched: boto3 talks HTTP to the server through `endpoint_url`, as it would to MinIO.
Requests are counted on the server side from werkzeug's request log (moto serves through
werkzeug), so that a test can prove that a second stage made no GET.

    with S3Server() as s3:
        s3.client().create_bucket(Bucket="data")
        ...
        assert s3.count("GET", "/data/key") == 1
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

# werkzeug logs each request as: 127.0.0.1 - - [date] "GET /bucket/key?x=1 HTTP/1.1" 200 -
_REQUEST = re.compile(r'"([A-Z]+) (\S+) HTTP/[0-9.]+" (\d{3})')
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class _RequestLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.requests: list[tuple[str, str, int]] = []
        self.guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        m = _REQUEST.search(record.getMessage())
        if m:
            with self.guard:
                self.requests.append((m[1], m[2].split("?", 1)[0], int(m[3])))


class S3Server:
    """moto's S3 server on 127.0.0.1 and a free port, with a server-side request log."""

    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._log = _RequestLog()
        self.endpoint_url = ""

    def __enter__(self) -> S3Server:
        logger = logging.getLogger("werkzeug")
        # With a handler of level INFO in place, werkzeug adds no console handler of its own.
        logger.setLevel(logging.INFO)
        logger.addHandler(self._log)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()
        logging.getLogger("werkzeug").removeHandler(self._log)

    def client(self) -> Any:
        """A boto3 client on this server (credentials are moto's fake ones)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def count(self, method: str, path: str) -> int:
        """Requests with this method on exactly this path (query string ignored)."""
        with self._log.guard:
            return sum(1 for m, p, _ in self._log.requests if m == method and p == path)


def fake_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials in the environment, and no endpoint variables that would override the
    endpoint a test passes (child processes inherit this environment)."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    for name in ("BERTH_S3_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """A module's S3 server (moto, over real HTTP)."""
    with S3Server() as server:
        yield server


@pytest.fixture
def aws(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The S3 server, with fake credentials and no endpoint variables in the environment."""
    fake_aws_environment(monkeypatch)
    return s3
