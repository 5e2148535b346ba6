"""Only Berth's triggers go on Berth's queue (docs/decisions/0030).

Berth's triggerers run every trigger on `BERTH_TRIGGER_QUEUE` with the store's URL and Berth's
Kubernetes rights. A deferring task reports its trigger's queue to Airflow's Execution API, which
stores it unchecked, and a task's queue can be changed by its own code at run time, after the
cluster policy saw the DAG: so task code could put a trigger class of its own there. This
middleware, on the root of Airflow's API server (a plugin's `fastapi_root_middlewares`), refuses
such a deferral before Airflow stores it: on Berth's queue, a trigger must be one of Berth's
(berth/trigger_queue.py BERTH_TRIGGERS). The task then fails, the refusal in its log.

A pure ASGI middleware: it reads the body of the one request it checks (the state update
`PATCH /execution/task-instances/<id>/state`) and hands the same bytes on; every other request
passes untouched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from berth.trigger_queue import deferral_violation

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STATE_UPDATE = re.compile(r"/execution/task-instances/[^/]+/state$")


class BerthQueueGuard:
    """Refuse (409) a deferral onto Berth's queue whose trigger is not Berth's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (
            scope["type"] == "http"
            and scope.get("method") == "PATCH"
            and STATE_UPDATE.search(scope.get("path", ""))
        ):
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message]), send)
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        why = _why(body)
        if why is None:
            replayed = {"type": "http.request", "body": body, "more_body": False}
            await self.app(scope, _replay([replayed], receive), send)
            return
        payload = json.dumps({"detail": why}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        await send({"type": "http.response.start", "status": 409, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _why(body: bytes) -> str | None:
    try:
        update = json.loads(body or b"{}")
    except ValueError:
        return None  # Airflow's own validation answers it
    if not isinstance(update, dict) or update.get("state") != "deferred":
        return None
    return deferral_violation(update.get("queue"), update.get("classpath"))


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """A `receive` that gives `messages` first, then what `then` gives (a disconnect)."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
