"""The Berth FastAPI app that the plugin mounts at `/berth` in Airflow's API server."""

from __future__ import annotations

from fastapi import FastAPI

from plugins.berth_api import metrics, routes

DESCRIPTION = """\
Berth's queue, quotas, jobs and GPUs, read from Berth's store.

Everything under `/berth/api/v1` needs an Airflow login: a JWT from `POST /auth/token` in
`Authorization: Bearer`, or the Airflow UI's session. `/berth/metrics` (Prometheus) needs none
and holds only per-team counts (docs/decisions/0015-berth-plugin-api.md).
"""


def create_app() -> FastAPI:
    app = FastAPI(title="Berth", description=DESCRIPTION, version="1")
    app.include_router(routes.router)
    app.include_router(metrics.router)
    return app
