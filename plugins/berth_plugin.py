"""Registers Berth's FastAPI app (plugins/berth_api) with Airflow, at `/berth` in the API server,
and its pages in Airflow's UI: "GPU queues" and "Cluster map" in the navigation, and "Berth
job" on every task instance (external views, shown in an iframe inside Airflow's UI). The API
server also keeps the team pools in step with the teams file, and refuses a deferral of a
trigger not Berth's onto Berth's queue (plugins/berth_api/queue_guard.py).

Every Airflow process loads the plugins folder: the scheduler, the triggerer, the DAG processor
and each task's process. Only the API server mounts the app, so the app (FastAPI, Airflow's
API security, which imports Airflow's models) is built when `fastapi_apps` is first read, not
when this file is imported: a task pays nothing for it.
"""

from __future__ import annotations

from functools import cache
from typing import Any
from urllib.parse import urlsplit

from airflow.plugins_manager import AirflowPlugin

URL_PREFIX = "/berth"


@cache
def berth_app() -> dict[str, Any]:
    """The app, built once per process; and, in the API server that mounts it, the team pools
    kept in step with the teams file (plugins/berth_api/pool_sync.py)."""
    from plugins.berth_api.app import create_app
    from plugins.berth_api.pool_sync import start_pool_sync

    start_pool_sync()
    return {"app": create_app(), "url_prefix": URL_PREFIX, "name": "Berth"}


def base_path() -> str:
    """The path of Airflow's `[api] base_url` without its trailing slash ("" at the root).
    Airflow's UI uses a view's `href` as it is, so the path must carry the base URL's."""
    from airflow.configuration import conf

    return urlsplit(conf.get("api", "base_url", fallback="") or "/").path.rstrip("/")


@cache
def berth_views() -> list[dict[str, Any]]:
    """The pages as Airflow 3 external views: `url_route` shows them inside Airflow's UI; a
    `task_instance` view's `href` gets the task instance's ids filled in by the UI."""
    at = base_path() + URL_PREFIX
    task = "dag_id={DAG_ID}&run_id={RUN_ID}&task_id={TASK_ID}&map_index={MAP_INDEX}"
    return [
        {
            "name": "GPU queues",
            "href": f"{at}/ui/queues",
            "url_route": "berth-queues",
            "destination": "nav",
            "nav_top_level": True,
            "icon": f"{at}/ui/static/icons/queues.svg",
            "icon_dark_mode": f"{at}/ui/static/icons/queues-dark.svg",
        },
        {
            "name": "Cluster map",
            "href": f"{at}/ui/cluster",
            "url_route": "berth-cluster",
            "destination": "nav",
            "nav_top_level": True,
            "icon": f"{at}/ui/static/icons/cluster.svg",
            "icon_dark_mode": f"{at}/ui/static/icons/cluster-dark.svg",
        },
        {
            "name": "Berth job",
            "href": f"{at}/ui/task?{task}",
            "url_route": "berth-job",
            "destination": "task_instance",
            "icon": f"{at}/ui/static/icons/queues.svg",
            "icon_dark_mode": f"{at}/ui/static/icons/queues-dark.svg",
        },
    ]


class BerthPlugin(AirflowPlugin):
    """Berth's REST API (`/berth/api/v1`), Prometheus metrics (`/berth/metrics`) and pages
    (`/berth/ui`)."""

    name = "berth"

    @property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [berth_app()]

    @property
    def fastapi_root_middlewares(self) -> list[dict[str, Any]]:  # type: ignore[override]
        from plugins.berth_api.queue_guard import BerthQueueGuard

        return [{"middleware": BerthQueueGuard, "name": "Berth's queue guard"}]

    @property
    def external_views(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return berth_views()
