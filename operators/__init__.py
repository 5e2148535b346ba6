"""Berth's Airflow side: the run operator and its triggers, the lifecycle TaskGroup.

Import `gpu_job` to describe a GPU job in a DAG; everything else is what it is made of. The
names load lazily: a triggerer or task process that imports one submodule (a trigger, a step)
does not pay for loading the operator and the TaskGroup too.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "gpu_job": "operators.lifecycle",
    "task_id_in": "operators.lifecycle",
    "FROM_PARAMS": "operators.params",
    "job_params": "operators.params",
    "BerthRunOperator": "operators.run",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'operators' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
