"""A free local port for a server that a test starts (Airflow, MLflow, PostgreSQL, etcd...)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: the OS picks it, so that tests
    running side by side do not collide (the server must bind it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
