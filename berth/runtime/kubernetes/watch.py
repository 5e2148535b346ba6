"""One list-and-watch per process of what following a gang reads: Berth's pods and Services and
the cluster's nodes (informer style, as client-go's shared informers; docs/decisions/0020).

Without it every poll of a gang asks the API server for its Service, its pods and each of its
nodes: six requests per poll of a 4-replica gang, once per gang every couple of seconds, which
made `bench.kube_bench` spend most of its time polling. With it a poll reads memory, and a
trigger waiting on a gang wakes when one of the gang's objects changes instead of at its next
tick.

The cache is a fast path, never a judge: `KubernetesRuntime.poll` answers "still running" from
it, and reads the API server again before anything that ends an attempt (a failure, a missing
pod, a start timeout, success), so a late or broken watch can delay news, never invent it. A
watch that has not been in contact for `stale_s` (a hung connection, an API server restart) is
not read at all until it has listed again.

Objects are kept as the API server sent them (`Lazy`) and made into the kubernetes client's
models only when read: a poll reads a few pods, while every pod's every change and every node's
heartbeat arrives as an event. Decoding each event into a model (its dates parsed, its nested
objects built, as the client's `Watch` does after encoding and decoding the JSON once more)
took over half of the benchmark process's CPU at 1,000 nodes, on the cores the API server needs.
When one is read, its timestamps are parsed by the standard library (`Decoder`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from berth.runtime.kubernetes.inventory import BERTH, MANAGED_BY
from berth.runtime.kubernetes.pods import ATTEMPT, JOB

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name); a node's namespace is ""
AttemptKey = tuple[str, str, str]  # (namespace, job label, attempt label)
BERTH_SELECTOR = f"{MANAGED_BY}={BERTH}"
GONE = 410  # the watch's resourceVersion is too old: list again


class Decoder(client.ApiClient):
    """The kubernetes client's deserializer, with timestamps read by `datetime.fromisoformat`.

    The API server writes every timestamp as RFC 3339 in UTC ('2026-11-29T05:57:22Z'), which
    the standard library reads (Python 3.11); the client reads it with dateutil's general
    parser, which took about two thirds of decoding a pod (py-spy, `bench.kube_bench` at
    1,000 nodes). Anything else goes to the client's parser, as before."""

    def _ApiClient__deserialize_datetime(self, string: str) -> Any:
        try:
            return datetime.fromisoformat(string)
        except (TypeError, ValueError):
            return super()._ApiClient__deserialize_datetime(string)  # type: ignore[misc]


class Lazy:
    """A watched object as the API server sent it (`raw`), made into the client's model of
    type `kind` (e.g. 'V1Pod') on the first read of an attribute; reads its key, labels and
    version from the JSON without that."""

    __slots__ = ("_kind", "_model", "raw")
    _decoder: Decoder | None = None  # one per process: only its deserializer is used

    def __init__(self, raw: dict[str, Any], kind: str) -> None:
        self.raw, self._kind, self._model = raw, kind, None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in Lazy.__slots__:  # copy's probes, a half-made copy
            raise AttributeError(name)
        model = self._model
        if model is None:  # two threads may both decode: the same model, either one kept
            decoder = Lazy._decoder
            if decoder is None:
                decoder = Lazy._decoder = Decoder()
            model = self._model = _decode(decoder, self.raw, self._kind)
        return getattr(model, name)

    @property
    def meta(self) -> dict[str, Any]:
        return self.raw.get("metadata") or {}


def _decode(decoder: client.ApiClient, raw: dict[str, Any], kind: str) -> Any:
    """`raw` as the client's model: its deserializer of parsed JSON where this client has it
    (what its public `deserialize` calls after parsing a response's text), else that public
    way, through the text again."""
    direct = getattr(decoder, "_ApiClient__deserialize", None)
    if direct is not None:
        return direct(raw, kind)
    return decoder.deserialize(SimpleNamespace(data=json.dumps(raw)), kind)


def object_key(obj: Any) -> Key:
    if isinstance(obj, Lazy):
        meta = obj.meta
        return meta.get("namespace") or "", meta.get("name", "")
    return obj.metadata.namespace or "", obj.metadata.name


def attempt_of(obj: Any) -> AttemptKey | None:
    """The attempt a pod or Service of Berth's belongs to (its labels), None for others."""
    if isinstance(obj, Lazy):
        namespace, labels = obj.meta.get("namespace"), obj.meta.get("labels") or {}
    else:
        namespace, labels = obj.metadata.namespace, obj.metadata.labels or {}
    job, attempt = labels.get(JOB), labels.get(ATTEMPT)
    if job is None or attempt is None:
        return None
    return namespace or "", job, attempt


class Informer:
    """The latest version of every object `list_fn` lists (with `label_selector`), kept by one
    daemon thread: list, then watch from the list's resourceVersion; list again when the API
    server says the version is gone (410) and, after a pause that doubles up to `max_pause_s`,
    on any other error. `on_change(kind, old, new)` runs on that thread for each change."""

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        *,
        label_selector: str | None = None,
        on_change: Callable[[str, Any, Any], None] | None = None,
        timeout_s: int = 30,
        stale_s: float = 90.0,
        max_pause_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < timeout_s < stale_s:
            raise ValueError(f"timeout_s ({timeout_s}) must be more than 0 and below stale_s")
        self.name = name
        self._list = list_fn
        self._kind = watch.Watch().get_return_type(list_fn)  # e.g. V1Pod, from its docstring
        self._selector = label_selector
        self._on_change = on_change
        self._timeout_s = timeout_s
        self._stale_s = stale_s
        self._max_pause_s = max_pause_s
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: dict[Key, Any] = {}
        self._contact = -float("inf")  # last time the API server answered this watch
        self._listed = False  # False from a failure until the next list
        self._stopping = threading.Event()
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None
        self.lists = 0  # how many times it listed (the first and every recovery)
        self.last_error: str | None = None

    # ---- reading ------------------------------------------------------------------------

    def fresh(self) -> bool:
        """Listed since the last failure and in contact within `stale_s`."""
        return self._listed and self._clock() - self._contact <= self._stale_s

    def get(self, namespace: str, name: str) -> Any | None:
        with self._lock:
            return self._objects.get((namespace, name))

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def wait_synced(self, timeout_s: float) -> bool:
        """Block until the first list has been read (True) or `timeout_s` passed (False)."""
        return self._synced.wait(timeout_s)

    # ---- the thread ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"berth-watch-{self.name}", daemon=True
            )
            self._thread.start()

    def stop(self, join_s: float = 0.0) -> None:
        """Stop after the current request (at most `timeout_s` later); join up to `join_s`."""
        self._stopping.set()
        if self._thread is not None and join_s > 0:
            self._thread.join(join_s)

    def _run(self) -> None:
        pause = 0.5
        while not self._stopping.is_set():
            try:
                version = self._relist()
                pause = 0.5
                while not self._stopping.is_set():
                    version = self._watch_from(version)
            except ApiException as e:
                if e.status == GONE:
                    continue  # expected now and then: list again at once
                self._failed(f"{e.status} {e.reason}")
            except Exception as e:  # a connection refused, reset or timed out
                if self._stopping.is_set():
                    return  # stopped, and the server went first: nothing to tell
                self._failed(f"{type(e).__name__}: {e}")
            if self._stopping.wait(pause):
                return
            pause = min(pause * 2, self._max_pause_s)

    def _failed(self, why: str) -> None:
        self._listed = False
        self.last_error = why
        log.warning("watch of %s broke (%s); listing again", self.name, why)

    def _relist(self) -> str:
        got = self._list(
            **self._args(), _request_timeout=self._timeout_s + 15, _preload_content=False
        )
        found = json.loads(got.data)
        items = [Lazy(raw, self._kind) for raw in found.get("items") or ()]
        fresh = {object_key(o): o for o in items}
        with self._lock:
            old, self._objects = self._objects, fresh
        self._contact = self._clock()
        self._listed = True
        self.lists += 1
        self._synced.set()
        if self._on_change is not None:
            for key in old.keys() - fresh.keys():
                self._on_change("DELETED", old[key], None)
            for key, obj in fresh.items():
                before = old.get(key)
                if before is None or _version(before) != _version(obj):
                    self._on_change("MODIFIED" if before else "ADDED", before, obj)
        return (found.get("metadata") or {}).get("resourceVersion") or ""

    def _watch_from(self, version: str) -> str:
        """Apply the events from `version` until the server ends the request (`timeout_s`);
        returns the version to go on from. ApiException(410) when the version is gone."""
        resp = self._list(
            **self._args(),
            watch=True,
            resource_version=version,
            timeout_seconds=self._timeout_s,
            allow_watch_bookmarks=True,
            _request_timeout=self._timeout_s + 15,  # a hung connection ends too
            _preload_content=False,
        )
        try:
            for line in watch.watch.iter_resp_lines(resp):
                if not line or line.isspace():
                    continue
                event = json.loads(line)
                self._contact = self._clock()
                kind, raw = event["type"], event["object"]
                if kind == "ERROR":  # e.g. 410: the version is gone, list again
                    why = f"{raw.get('reason')}: {raw.get('message')}"
                    raise ApiException(status=raw.get("code"), reason=why)
                version = (raw.get("metadata") or {}).get("resourceVersion") or version
                if kind == "BOOKMARK":
                    continue
                obj = Lazy(raw, self._kind)
                key = object_key(obj)
                with self._lock:
                    old = self._objects.get(key)
                    if kind == "DELETED":
                        self._objects.pop(key, None)
                    else:
                        self._objects[key] = obj
                if self._on_change is not None:
                    self._on_change(kind, old, None if kind == "DELETED" else obj)
                if self._stopping.is_set():
                    break
        finally:
            resp.close()
            resp.release_conn()
        self._contact = self._clock()  # the server closed the request on time: still there
        return version

    def _args(self) -> dict[str, Any]:
        return {} if self._selector is None else {"label_selector": self._selector}


def _version(obj: Any) -> str | None:
    if isinstance(obj, Lazy):
        return obj.meta.get("resourceVersion")
    return obj.metadata.resource_version


class ClusterWatch:
    """Berth's pods in every namespace and the cluster's nodes, each kept by an `Informer`, and
    Berth's Services per team namespace, watched from the first time a gang there is followed
    (the runtime may read Services only in team namespaces: docker/chart/templates/rbac.yaml).
    `changed` lets a trigger wait until one of an attempt's objects changes."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        timeout_s: int = 30,
        stale_s: float = 90.0,
        max_pause_s: float = 30.0,
    ):
        self._core = client.CoreV1Api(api)
        self._lock = threading.Lock()
        self._generations: dict[Hashable, int] = {}
        self._live: dict[Hashable, int] = {}  # objects of each attempt: its entries go with them
        self._waiters: dict[Hashable, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._nodes_generation = 0
        self._kw: dict[str, Any] = {
            "timeout_s": timeout_s, "stale_s": stale_s, "max_pause_s": max_pause_s,
        }  # fmt: skip
        self._started = False
        self.pods = Informer(
            "pods", self._core.list_pod_for_all_namespaces, label_selector=BERTH_SELECTOR,
            on_change=self._attempt_changed, **self._kw,
        )  # fmt: skip
        self.nodes = Informer(
            "nodes", self._core.list_node, on_change=self._node_changed, **self._kw
        )
        self._services: dict[str, Informer] = {}

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        """Start the pods' and nodes' informers (again: nothing)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self.pods.start()
        self.nodes.start()

    def stop(self, join_s: float = 0.0) -> None:
        with self._lock:
            informers = [self.pods, self.nodes, *self._services.values()]
            self._started = False
        for informer in informers:
            informer.stop()
        for informer in informers:
            informer.stop(join_s)

    def fresh(self) -> bool:
        """The pods and nodes are fresh (the Services of each namespace: `services`)."""
        return self.pods.fresh() and self.nodes.fresh()

    def wait_synced(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(
            i.wait_synced(max(deadline - time.monotonic(), 0)) for i in (self.pods, self.nodes)
        )

    def services(self, namespace: str) -> Informer:
        """Berth's Services in `namespace`, watched from the first call on (until the first
        list is read the informer is not `fresh`)."""
        with self._lock:
            informer = self._services.get(namespace)
            if informer is None:
                core = self._core

                def list_services(**kw: Any) -> Any:
                    return core.list_namespaced_service(namespace, **kw)

                # The kubernetes client's Watch reads the return type from the docstring.
                list_services.__doc__ = core.list_namespaced_service.__doc__
                informer = Informer(
                    f"services/{namespace}", list_services, label_selector=BERTH_SELECTOR,
                    on_change=self._attempt_changed, **self._kw,
                )  # fmt: skip
                self._services[namespace] = informer
                if self._started:
                    informer.start()
            return informer

    def generation(self, key: AttemptKey) -> int:
        """A number that grows with every change to the attempt's pods, its Service, or a
        node's existence."""
        with self._lock:
            return self._generations.get(key, 0) + self._nodes_generation

    async def changed(self, key: AttemptKey, since: int, timeout_s: float) -> None:
        """Return once `generation(key)` is past `since`, or after `timeout_s`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        entry = (loop, future)
        with self._lock:
            gone = key not in self._generations and since > self._nodes_generation
            if gone or self._generations.get(key, 0) + self._nodes_generation > since:
                return  # changed, or every object of the attempt went since
            self._waiters.setdefault(key, []).append(entry)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                waiting = self._waiters.get(key, [])
                if entry in waiting:
                    waiting.remove(entry)
                if not waiting:
                    self._waiters.pop(key, None)

    def _attempt_changed(self, kind: str, old: Any, new: Any) -> None:
        key = attempt_of(new if new is not None else old)
        if key is None:
            return
        with self._lock:
            live = self._live.get(key, 0) + (old is None) - (new is None)
            if live > 0:
                self._live[key] = live
                self._generations[key] = self._generations.get(key, 0) + 1
            else:  # the attempt's last object went: forget it (a triggerer runs for months)
                self._live.pop(key, None)
                self._generations.pop(key, None)
            waiters = self._waiters.pop(key, [])
        _wake(waiters)

    def _node_changed(self, kind: str, old: Any, new: Any) -> None:
        if kind not in ("ADDED", "DELETED"):
            return  # only a node's existence is read from here
        with self._lock:
            self._nodes_generation += 1
            waiters = [w for ws in self._waiters.values() for w in ws]
            self._waiters.clear()
        _wake(waiters)


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    for loop, future in waiters:
        with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits any more
            loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
