"""`berth`, the product's command line: the engine's commands (scheduling/cli.py: simulate,
trace, check, jobs, job, usage, cancel) plus those that talk to Airflow (`berth pools sync`).
Airflow itself is never imported here: pools are synced over its REST API."""

from __future__ import annotations

from typing import Annotated

import typer

from operators.pools import PoolSyncError, sync_pools
from scheduling.cli import app, console
from scheduling.settings import settings

pools_app = typer.Typer(help="Airflow pools that mirror the teams' GPU quotas.")
app.add_typer(pools_app, name="pools")


@pools_app.command("sync")
def pools_sync(
    api_url: Annotated[str, typer.Option(help="Airflow's API server")] = "http://localhost:8080",
    username: Annotated[str, typer.Option(help="an Airflow admin")] = "admin",
    password: Annotated[
        str, typer.Option(envvar="BERTH_ADMIN_PASSWORD", help="its password")
    ] = "berth-admin",
) -> None:
    """Create or update `berth-<team>` pools: slots = the team's reachable GPUs."""
    s = settings()
    try:
        done = sync_pools(api_url, username, password, s.teams(), s.cluster())
    except PoolSyncError as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    for name, what in done.items():
        typer.echo(f"{name}: {what}")
