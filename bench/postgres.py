"""A throwaway PostgreSQL server, for the store's tests (tests/pg.py) and its benchmark.

`throwaway()` runs `initdb` and `pg_ctl` from PATH or /usr/lib/postgresql/*/bin: a server in a
temp dir, listening only on a unix socket there, fsync off, stopped and deleted at the end. As
root it runs as the `postgres` user (initdb refuses root). `Unavailable` says why it cannot.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from sqlalchemy.engine import URL


class Unavailable(RuntimeError):
    """No PostgreSQL server can be started here (the message says why)."""


class PostgresServer:
    """A server databases may be created on."""

    def __init__(self, admin_url: URL) -> None:
        self.admin_url = admin_url
        self._names = itertools.count()
        self.created: list[str] = []

    def _connect(self) -> psycopg.Connection:
        u = self.admin_url
        kwargs = {k: v for k, v in u.query.items() if isinstance(v, str)}
        return psycopg.connect(
            dbname=u.database or "postgres",
            user=u.username,
            password=u.password,
            host=kwargs.pop("host", u.host),
            port=kwargs.pop("port", u.port),
            autocommit=True,
            **kwargs,
        )

    def new_database(self) -> str:
        """A fresh, empty database; returns its SQLAlchemy URL."""
        name = f"berth_test_{os.getpid()}_{next(self._names)}"
        with self._connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        self.created.append(name)
        return self.admin_url.set(database=name).render_as_string(hide_password=False)

    def drop_created(self) -> None:
        with self._connect() as conn:
            for name in self.created:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def find_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version)
    return candidates[-1] if candidates else None


def _version(path: str) -> int:
    part = Path(path).parts[-3]
    return int(part) if part.isdigit() else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def throwaway(max_connections: int = 50) -> Iterator[PostgresServer]:
    """A new server for the duration of the block; raises Unavailable if none can start."""
    initdb, pg_ctl = find_bin("initdb"), find_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        raise Unavailable("initdb/pg_ctl are not on PATH nor under /usr/lib/postgresql/*/bin")
    prefix: list[str] = []
    # Not under a tmp dir private to root: the server runs as postgres.
    base = Path(tempfile.mkdtemp(prefix="berth-pg-"))
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            shutil.rmtree(base, ignore_errors=True)
            raise Unavailable("running as root and runuser is missing (initdb refuses root)")
        prefix = [runuser, "-u", "postgres", "--"]
        shutil.chown(base, "postgres", "postgres")
    data, log = base / "data", base / "server.log"
    port = _free_port()
    try:
        subprocess.run(
            [*prefix, initdb, "-D", str(data), "-U", "berth", "--auth=trust", "-E", "UTF8",
             "--no-sync", "--no-instructions"],
            check=True,
            capture_output=True,
            timeout=120,
        )  # fmt: skip
        options = (
            f"-p {port} -k {base} -c listen_addresses='' -c fsync=off "
            f"-c max_connections={max_connections}"
        )
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60",
             "start"],
            check=True,
            capture_output=True,
            timeout=90,
        )  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        out = getattr(e, "stderr", b"") or b""
        tail = log.read_text()[-2000:] if log.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(
            f"could not start PostgreSQL: {e}\n{out.decode(errors='replace')}\n{tail}"
        ) from e
    url = URL.create(
        "postgresql+psycopg",
        username="berth",
        database="postgres",
        query={"host": str(base), "port": str(port)},
    )
    try:
        yield PostgresServer(url)
    finally:
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(base, ignore_errors=True)
