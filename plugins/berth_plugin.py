"""Registers Berth's FastAPI app (plugins/berth_api) with Airflow, at `/berth` in the API server.

Every Airflow process loads the plugins folder: the scheduler, the triggerer, the DAG processor
and each task's process. Only the API server mounts the app, so the app (FastAPI, Airflow's
API security, which imports Airflow's models) is built when `fastapi_apps` is first read, not
when this file is imported: a task pays nothing for it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from airflow.plugins_manager import AirflowPlugin

URL_PREFIX = "/berth"


@cache
def berth_app() -> dict[str, Any]:
    """The app, built once per process."""
    from plugins.berth_api.app import create_app

    return {"app": create_app(), "url_prefix": URL_PREFIX, "name": "Berth"}


class BerthPlugin(AirflowPlugin):
    """Berth's REST API (`/berth/api/v1`) and Prometheus metrics (`/berth/metrics`)."""

    name = "berth"

    @property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [berth_app()]
