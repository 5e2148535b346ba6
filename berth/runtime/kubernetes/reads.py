"""What the API server's answers mean. Reading an object that may be gone: a person, a garbage
collector or another poller may delete Berth's objects at any time, and a 404 then is an answer,
not an error. An API server that is away or overloaded (no answer, 429, 5xx) says "not now",
not "no": the runtime then raises RuntimeUnavailable and the caller asks again."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import urllib3
from kubernetes.client.exceptions import ApiException

from berth.runtime.base import RuntimeUnavailable
from berth.runtime.kubernetes.status import api_problem

T = TypeVar("T")
MERGE_PATCH = "application/merge-patch+json"  # a patch of only the fields it names
# Answers that say "not now" rather than "no": a poll then knows nothing (RuntimeUnavailable).
UNAVAILABLE = frozenset({429, 500, 502, 503, 504})


def read_or_none(read: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """`read(*args, **kwargs)` (a client's `read_namespaced_*`), or None when the API server
    answers 404; any other refusal is raised."""
    try:
        return read(*args, **kwargs)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def without_body(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`call(*args, **kwargs)` (a create, patch or delete whose answer is not used) without the
    client's making its answer into models: at a thousand pods a minute that decoding costs
    about as much of the process's CPU as the requests do. Refusals raise as from `call`."""
    resp = call(*args, _preload_content=False, **kwargs)
    resp.read()
    resp.release_conn()


def created_uid(call: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The uid of the object `call` (a client's `create_namespaced_*`) made, read from its JSON
    answer without the client's models (see `without_body`)."""
    resp = call(*args, _preload_content=False, **kwargs)
    try:
        return str(json.loads(resp.data)["metadata"]["uid"])
    finally:
        resp.release_conn()


def unless_gone(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`without_body(call, ...)` on an object that may be gone already (404: nothing to do)."""
    try:
        without_body(call, *args, **kwargs)
    except ApiException as e:
        if e.status != 404:
            raise


def unavailable(e: BaseException) -> bool:
    """An API server that is away or overloaded (no answer, 429, 5xx), not one that said no."""
    if isinstance(e, ApiException):
        return e.status in UNAVAILABLE
    return isinstance(e, urllib3.exceptions.HTTPError | OSError)


@contextmanager
def unavailable_as(what: str) -> Iterator[None]:
    """Raise RuntimeUnavailable (saying `what`) for an API server that is away; anything else
    as it is."""
    try:
        yield
    except Exception as e:
        if isinstance(e, RuntimeUnavailable) or not unavailable(e):
            raise
        why = f"it answered {api_problem(e)}" if isinstance(e, ApiException) else str(e)
        raise RuntimeUnavailable(f"{what}, the API server being away: {why}") from None
