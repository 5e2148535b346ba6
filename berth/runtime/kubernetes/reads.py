"""Reading an object that may be gone: a person, a garbage collector or another poller may
delete Berth's objects at any time, and a 404 then is an answer, not an error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes.client.exceptions import ApiException

T = TypeVar("T")


def read_or_none(read: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """`read(*args, **kwargs)` (a client's `read_namespaced_*`), or None when the API server
    answers 404; any other refusal is raised."""
    try:
        return read(*args, **kwargs)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
