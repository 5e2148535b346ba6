"""Where the plugin finds the store: the settings every Berth process reads (`BERTH_HOME`,
`BERTH_STORE_URL`, `BERTH_CLUSTER`, `BERTH_TEAMS`, `BERTH_POLICY_FILE`), so the API server sees
the jobs, cluster and teams that the operators, triggers and `berth` CLI see."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends

from berth.settings import settings
from berth.store import Store


def current_store() -> Store:
    """One Store per process and settings (`BerthSettings.store` caches it)."""
    return settings().store()


StoreDep = Annotated[Store, Depends(current_store)]
