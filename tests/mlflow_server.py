"""A real MLflow tracking server for tests: SQLite backend store, proxied local artifacts.

It can be stopped and started again on the same port and store, to test what happens to the
platform's record while the server is away.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from ports import free_port
from waiting import wait_for

MLFLOW = Path(sys.executable).with_name("mlflow")


class MlflowServer:
    def __init__(
        self,
        root: Path,
        port: int | None = None,
        *,
        backend_uri: str | None = None,
        artifacts_destination: str | None = None,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.root = root
        self.extra_args = list(extra_args or ())
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
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # stop() takes the workers down with it
        )
        proc = self.proc

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited; see {self.root / 'server.log'}")
            try:
                return httpx.get(f"{self.uri}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:  # polled every 0.2 s: a starting server
            wait_for(healthy, f"the MLflow server at {self.uri}", timeout_s, 0.2)
        except pytest.fail.Exception:
            self.stop()
            raise

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
