"""A real MLflow tracking server for tests: SQLite backend store, proxied local artifacts.

It can be stopped and started again on the same port and store, to test what happens to the
platform's record while the server is away.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MLFLOW = Path(sys.executable).with_name("mlflow")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(
        self,
        root: Path,
        port: int | None = None,
        *,
        backend_uri: str | None = None,
        artifacts_destination: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.port = port or free_port()
        self.backend_uri = backend_uri or f"sqlite:///{root / 'mlflow.db'}"
        self.artifacts_destination = artifacts_destination or str(root / "artifacts")
        self.env = {**os.environ, **(env or {})}
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    def start(self, timeout_s: float = 120.0) -> None:
        log = (self.root / "server.log").open("ab")
        self.proc = subprocess.Popen(
            [
                str(MLFLOW),
                "server",
                "--backend-store-uri",
                self.backend_uri,
                "--artifacts-destination",
                self.artifacts_destination,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "2",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # stop() takes the workers down with it
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited; see {self.root / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)  # polling a starting server, with a deadline
        self.stop()
        raise RuntimeError(f"mlflow server not up within {timeout_s} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
