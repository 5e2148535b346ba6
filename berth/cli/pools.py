"""`berth pools sync`: Airflow pools that mirror the teams' GPU quotas (berth/pools.py).

Synced over Airflow's REST API; Airflow itself is never imported here."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from berth.pools import PoolSyncError, sync_pools
from berth.settings import settings

err = Console(stderr=True)


def register(app: typer.Typer) -> None:
    pools_app = typer.Typer(help="Airflow pools that mirror the teams' GPU quotas.")
    pools_app.command("sync")(pools_sync)
    app.add_typer(pools_app, name="pools")


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
        err.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    for name, what in done.items():
        typer.echo(f"{name}: {what}")
