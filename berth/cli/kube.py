"""`berth kube manifests`: the per-team objects of a cluster, from the teams file
(berth/runtime/kubernetes/team_objects.py), as YAML for `kubectl apply -f -`.

Every file is validated first, as the processes that mount it would read it: a bad field fails
here, naming the file and the field, instead of in the first task after the rollout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console

from berth.access import AccessError, load_access
from berth.runtime.kubernetes.config import load_kube_config
from berth.runtime.kubernetes.team_objects import Options, TeamObjectsError, team_objects
from scheduling.config import ConfigError, load_teams
from scheduling.policy_file import load_policy

err = Console(stderr=True)

# What the values and the image expect in the ConfigMap (docker/airflow/Dockerfile sets
# BERTH_TEAMS and BERTH_KUBE_SETTINGS to these; BERTH_POLICY_FILE and BERTH_ACCESS are opt-in).
TEAMS, KUBE, POLICY, ACCESS = "teams.yaml", "kube.yaml", "policy.yaml", "access.yaml"
NO_KUBE_SETTINGS = "# Berth's Kubernetes settings: every default (docker/config/kube.yaml)\n{}\n"


def register(app: typer.Typer) -> None:
    kube_app = typer.Typer(help="What Berth needs on a Kubernetes cluster.")
    kube_app.command("manifests")(manifests)
    app.add_typer(kube_app, name="kube")


def manifests(
    teams: Annotated[Path, typer.Option(help="teams.yaml")],
    kube_settings: Annotated[
        Path | None, typer.Option(help="Berth's Kubernetes settings (docker/config/kube.yaml)")
    ] = None,
    policy: Annotated[
        Path | None, typer.Option(help="a policy file, for BERTH_POLICY_FILE")
    ] = None,
    access: Annotated[Path | None, typer.Option(help="an access file, for BERTH_ACCESS")] = None,
    system_namespace: Annotated[
        str, typer.Option(help="where Airflow and Berth's ServiceAccount run")
    ] = "berth-system",
    service_account: Annotated[str, typer.Option(help="Berth's ServiceAccount")] = "berth-runtime",
    config_map: Annotated[str, typer.Option(help="the ConfigMap mounted at /etc/berth")] = (
        "berth-config"
    ),
    storage_class: Annotated[
        str | None,
        typer.Option(help="make each team's data and checkpoint volumes with this class (RWX)"),
    ] = None,
    volume_size: Annotated[str, typer.Option(help="the size of each team volume made")] = "100Gi",
    home_size: Annotated[str, typer.Option(help="the size of the berth-home volume")] = "20Gi",
    builds: Annotated[
        bool, typer.Option(help="bind berth-builder-team where image builds run")
    ] = False,
    build_namespace: Annotated[
        str | None, typer.Option(help="BERTH_BUILD_NAMESPACE, if all builds run in one")
    ] = None,
) -> None:
    """Print the team namespaces, RoleBindings, volumes and the berth-config ConfigMap."""
    try:
        known = load_teams(teams)
        kube = load_kube_config(kube_settings)
        files = {TEAMS: teams.read_text(), KUBE: NO_KUBE_SETTINGS}
        if kube_settings is not None:
            files[KUBE] = kube_settings.read_text()
        if policy is not None:
            load_policy(policy)
            files[POLICY] = policy.read_text()
        if access is not None:
            load_access(access, known)
            files[ACCESS] = access.read_text()
        options = Options(
            system_namespace=system_namespace,
            service_account=service_account,
            config_map=config_map,
            storage_class=storage_class,
            volume_size=volume_size,
            home_size=home_size,
            builds=builds,
            build_namespace=build_namespace,
        )
        made = team_objects(known, kube, files, options)
    except (ConfigError, AccessError, TeamObjectsError) as e:
        err.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    typer.echo(
        f"# made by `berth kube manifests` for {len(known)} teams; they bind "
        "the roles of Berth's chart (docker/chart)"
    )
    typer.echo(yaml.dump_all(made.objects, Dumper=_Dumper, sort_keys=False), nl=False)
    for note in made.notes:
        err.print(f"[yellow]note:[/] {note}")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the files in the ConfigMap) as literal blocks, readable in a diff."""


def _text(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)
