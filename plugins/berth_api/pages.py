"""Berth's pages (`/berth/ui/...`): plain HTML, CSS and JavaScript files in `static/`, which
fetch `/berth/api/v1` and refresh on their own (docs/decisions/0015, "Pages").

The pages themselves hold no data and need no login: the data comes from the API, which asks
for Airflow's login, so a page opened without one can say so (401) instead of failing blank.
Every URL in them is relative to where the browser loaded them, so they work under any
`[api] base_url` and behind a proxy that strips a prefix.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"

# Scripts and styles only from our own files, never inline, and the pages framed only by
# Airflow's UI (same origin): a job name that slipped past escaping still could not run.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'self'"
    ),
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}

router = APIRouter(prefix="/ui", include_in_schema=False)


def _page(name: str) -> FileResponse:
    return FileResponse(STATIC / name, media_type="text/html", headers=HEADERS)


@router.get("/queues")
def queues() -> FileResponse:
    """GPU queues: each team's quota bar and its waiting jobs."""
    return _page("queues.html")


@router.get("/cluster")
def cluster() -> FileResponse:
    """Cluster map: every GPU by topology domain, coloured by the team holding it."""
    return _page("cluster.html")


@router.get("/jobs/{job_id}")
def job(job_id: str) -> FileResponse:
    """One job's page; the script reads the id from the URL."""
    return _page("job.html")


@router.get("/task")
def task() -> FileResponse:
    """The Berth job of an Airflow task instance (`?dag_id=&run_id=&task_id=&map_index=`):
    the view Airflow's UI shows on a task instance; it opens the job's page."""
    return _page("task.html")


def add_pages(app: FastAPI) -> None:
    """The pages' routes and their static files (`/ui/static`)."""
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="static")
