"""Who may spend a team's quota: the Airflow users each team admits (`BERTH_ACCESS`).

Without an access file anyone who may trigger a DAG run may submit to any team: the embedded
default, one machine and its one user. With one, a job's team must list the Airflow user who
triggered the run (Airflow's `triggering_user_name`), or the job is refused before anything is
queued, by the validate step and again by the run task; cancelling through the Berth plugin
asks the same of the user who cancels. A team the file does not list admits only `admins`.
Runs nobody triggered (a schedule, an asset) have no user: their DAG's code names the team, and
whoever may deploy DAG files decides that, so they pass.

```yaml
# access.yaml
admins: [alice]              # may use every team
teams:
  vision: [bob, carol]
  research: [dave]
```

Airflow's trigger form cannot be filtered per user (its choices are parsed once per DAG file),
so the form lists every team and the refusal names the user, the team and the fix.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class AccessError(ValueError):
    """The access file is malformed or names unknown teams; the message says where and how."""


class AccessFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    admins: tuple[str, ...] = Field(default=(), description="users who may use every team")
    teams: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="team -> the Airflow users it admits"
    )


class Access:
    """The parsed file: `allows(user, team)` and the words of a refusal."""

    def __init__(self, spec: AccessFile, path: Path) -> None:
        self.path = path
        self.admins = frozenset(spec.admins)
        self.members = {team: frozenset(users) for team, users in spec.teams.items()}

    def allows(self, user: str | None, team: str) -> bool:
        """True when `user` may submit to `team` and cancel its jobs; None (no user: a
        scheduled run) passes."""
        return user is None or user in self.admins or user in self.members.get(team, ())

    def teams_of(self, user: str) -> list[str]:
        """The teams `user` may use (every listed team for an admin)."""
        if user in self.admins:
            return sorted(self.members)
        return sorted(team for team, users in self.members.items() if user in users)

    def refusal(self, user: str, team: str, doing: str = "submit jobs to") -> str:
        mine = self.teams_of(user)
        yours = f"your teams: {', '.join(mine)}" if mine else "you are in no team"
        return (
            f"team: user {user!r} may not {doing} team {team!r} ({yours}); pick one of yours, "
            f"or ask an admin to add {user!r} under teams.{team} in {self.path}"
        )


def load_access(path: Path, teams: Collection[str]) -> Access:
    """Read and check the file against the configured `teams` (AccessError names what is
    wrong and the fix)."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise AccessError(f"{path}: cannot read it as YAML ({e}); see berth/access.py") from None
    try:
        spec = AccessFile.model_validate(raw or {})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}" for err in e.errors()
        )
        raise AccessError(
            f"{path}: {problems}; the file holds `admins: [users]` and `teams: {{team: [users]}}`"
        ) from None
    unknown = sorted(set(spec.teams) - set(teams))
    if unknown:
        raise AccessError(
            f"{path}: teams.{unknown[0]}: no such team in the teams file (unknown: "
            f"{', '.join(unknown)}; known: {', '.join(sorted(teams))}); fix the name or add the "
            "team to the teams file"
        )
    return Access(spec, path)


def user_of(dag_run: object | None) -> str | None:
    """The Airflow user who triggered a DAG run, if one did."""
    return getattr(dag_run, "triggering_user_name", None) or None


def check(access: Access | None, user: str | None, team: str) -> str | None:
    """None when allowed (or no access file), else the refusal."""
    if access is None or access.allows(user, team):
        return None
    assert user is not None
    return access.refusal(user, team)
