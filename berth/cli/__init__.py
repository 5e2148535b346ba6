"""`berth`, the product's command line: every command is registered here.

- `simulate`, `trace import`, `policies`, `check` (simulate.py): the simulator and its inputs;
- `jobs`, `job`, `usage`, `cancel` (jobs.py): what on-call asks of the store;
- `pools sync` (pools.py): Airflow pools over Airflow's REST API (Airflow is never imported);
- `scheduler` (scheduler.py): the long-lived scheduling loop;
- `kube manifests` (kube.py): the per-team objects of a Kubernetes cluster.
"""

from __future__ import annotations

import typer

from berth.cli import jobs, kube, pools, scheduler, simulate

app = typer.Typer(help="Berth: GPU job scheduling for ML teams.", no_args_is_help=True)
simulate.register(app)
jobs.register(app)
pools.register(app)
scheduler.register(app)
kube.register(app)

__all__ = ["app"]
