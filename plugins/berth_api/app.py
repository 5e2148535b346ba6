"""The Berth FastAPI app that the plugin mounts at `/berth` in Airflow's API server: the REST
API, the Prometheus metrics and the pages (`pages.py`)."""

from __future__ import annotations

from fastapi import FastAPI

from plugins.berth_api import metrics, routes
from plugins.berth_api.pages import add_pages

DESCRIPTION = """\
Berth's queue, quotas, jobs and GPUs, read from Berth's store.

Everything under `/berth/api/v1` needs an Airflow login: a JWT from `POST /auth/token` in
`Authorization: Bearer`, or the Airflow UI's session. `/berth/metrics` (Prometheus) needs none
and holds only per-team counts (docs/decisions/0015-berth-plugin-api.md). The pages under
`/berth/ui` (GPU queues, cluster map, one job) read this API from the browser.
"""


def create_app() -> FastAPI:
    app = FastAPI(title="Berth", description=DESCRIPTION, version="1")
    app.include_router(routes.router)
    app.include_router(metrics.router)
    add_pages(app)
    return app
