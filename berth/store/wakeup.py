"""Wake-ups without polling: a committed change wakes whoever waits for one.

Every locked transaction that changed what the engine sees (it bumped the store's version:
database.py) wakes the listeners once it has committed:

- PostgreSQL: `NOTIFY berth_changes` inside the transaction, which PostgreSQL delivers only
  if it commits; a listener LISTENs on a connection of its own.
- SQLite has no NOTIFY. A listener binds a Unix datagram socket in the folder `<db file>.wake/`;
  a committed change sends one byte to each socket there (one whose listener died is removed).
  Sending never blocks: a full socket already has a wake-up waiting. Where that folder's path
  is too long for a socket (108 bytes on Linux), the socket is bound in Linux's abstract
  namespace and an empty file `<name>.abstract` in the folder says where it listens.

`Listener.wait(timeout)` returns True when woken and False at the timeout; the wake-ups of a
burst of changes are drained together, so a burst costs one wake-up. A listener is a hint to
look, never the truth: what changed is read from the tables (mirror.py), and whoever waits
also wakes at its own timeout (a lost datagram, a listener started after the change).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import uuid
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, text

CHANNEL = "berth_changes"
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux
_ABSTRACT = ".abstract"  # a marker file for a socket in Linux's abstract namespace


class Listener(Protocol):
    def wait(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


def notify_in(conn: Connection) -> None:
    """Inside a locked transaction that changed something: wake the listeners on commit
    (PostgreSQL; SQLite's are woken by `woken_after_commit`)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"NOTIFY {CHANNEL}"))


def woken_after_commit(engine: Engine) -> None:
    """After such a transaction committed: wake SQLite's listeners."""
    folder = _folder(engine)
    if folder is None:
        return
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        for name in names:
            if name.endswith(".sock"):
                address = path = os.path.join(folder, name)
            elif name.endswith(_ABSTRACT):
                path = os.path.join(folder, name)
                address = _abstract_address(name)
            else:
                continue
            try:
                s.sendto(b"!", address)
            except BlockingIOError:  # its buffer is full: a wake-up is already waiting
                pass
            except (ConnectionRefusedError, FileNotFoundError):  # its listener is gone
                with contextlib.suppress(OSError):
                    os.unlink(path)
            except OSError:
                pass


def listen(engine: Engine) -> Listener:
    """A listener for this store's committed changes."""
    if engine.dialect.name == "postgresql":
        return _PostgresListener(engine)
    folder = _folder(engine)
    if folder is not None:
        name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = os.path.join(folder, f"{name}.sock")
        if len(path) <= _MAX_SOCKET_PATH:
            return _SocketListener(folder, path, path)
        if sys.platform == "linux":
            marker = os.path.join(folder, f"{name}{_ABSTRACT}")
            return _SocketListener(folder, marker, _abstract_address(marker))
    return _Timeout()  # a path too long for a socket elsewhere: wake at the timeout only


def _abstract_address(marker: str) -> str:
    # The name is unique (pid and a random part), so the address is too, across databases.
    return "\0berth-wake-" + os.path.basename(marker).removesuffix(_ABSTRACT)


def _folder(engine: Engine) -> str | None:
    if engine.dialect.name != "sqlite" or not engine.url.database:
        return None
    return str(Path(engine.url.database).resolve()) + ".wake"


class _SocketListener:
    """`path`: the socket's file in the folder, or the marker of its abstract `address`."""

    def __init__(self, folder: str, path: str, address: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)
        if address != path:  # bound first, so a sender never finds a marker with no socket
            Path(path).touch()

    def wait(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not ready:
            return False
        with contextlib.suppress(BlockingIOError):
            while self.sock.recv(64):  # drain the burst
                pass
        return True

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class _PostgresListener:
    def __init__(self, engine: Engine) -> None:
        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        self.conn: Any = engine.dialect.loaded_dbapi.connect(*cargs, **cparams)
        self.conn.autocommit = True
        self.conn.execute(f"LISTEN {CHANNEL}")

    def wait(self, timeout: float) -> bool:
        woken = any(True for _ in self.conn.notifies(timeout=max(0.0, timeout), stop_after=1))
        if woken:  # drain the burst
            for _ in self.conn.notifies(timeout=0.0):
                pass
        return woken

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class _Timeout:
    def wait(self, timeout: float) -> bool:
        select.select([], [], [], max(0.0, timeout))
        return False

    def close(self) -> None:
        pass
