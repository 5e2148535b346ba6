"""A gang's replicas created side by side: each replica's objects are independent requests, so a
64-replica gang starts in a few round trips instead of 64 in a row."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _pool() -> ThreadPoolExecutor:
    # One per process, shared by every launch: the API server, not these threads, sets the pace.
    return ThreadPoolExecutor(max_workers=16, thread_name_prefix="berth-launch")


_POOL = _pool()
# A forked child (Airflow forks its task processes) inherits the pool's bookkeeping but not its
# threads, and would wait for ever on its first launch: it makes its own.
os.register_at_fork(after_in_child=lambda: globals().update(_POOL=_pool()))


def side_by_side(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`[fn(x) for x in items]`, run at once on the process's pool (in this thread for one
    item); `fn` must catch what it expects to fail."""
    if len(items) == 1:
        return [fn(items[0])]
    return list(_POOL.map(fn, items))
