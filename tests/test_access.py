"""Who may use a team (berth/access.py): the file, its errors, and the decision."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from berth.access import AccessError, check, load_access, user_of
from berth.settings import BerthSettings

TEAMS = ("vision", "language", "research")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "access.yaml"
    path.write_text(text)
    return path


def test_a_team_admits_its_users_and_the_admins(tmp_path: Path) -> None:
    access = load_access(
        write(tmp_path, "admins: [root]\nteams:\n  vision: [bob]\n  research: [bob, dave]\n"),
        TEAMS,
    )
    assert access.allows("bob", "vision") and access.allows("dave", "research")
    assert not access.allows("dave", "vision")
    assert not access.allows("bob", "language")  # a team the file does not list: admins only
    assert access.allows("root", "language") and access.allows("root", "vision")
    assert access.allows(None, "vision")  # nobody triggered it (a schedule): the DAG decides
    assert access.teams_of("bob") == ["research", "vision"]
    assert access.teams_of("root") == ["research", "vision"]
    refusal = check(access, "dave", "vision")
    assert refusal is not None
    assert refusal.startswith("team: user 'dave' may not submit jobs to team 'vision'")
    assert "(your teams: research)" in refusal and "teams.vision in" in refusal
    assert "you are in no team" in (check(access, "eve", "vision") or "")
    assert check(None, "eve", "vision") is None  # no access file: every user, every team


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("teams:\n  visoin: [bob]\n", "teams.visoin: no such team in the teams file"),
        ("teams:\n  vision: bob\n", "teams.vision"),
        ("users: [bob]\n", "users: Extra inputs are not permitted"),
        ("teams: [\n", "cannot read it as YAML"),
    ],
)
def test_a_bad_file_says_where_and_how_to_fix_it(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(AccessError) as e:
        load_access(write(tmp_path, text), TEAMS)
    assert says in str(e.value) and str(tmp_path / "access.yaml") in str(e.value)


def test_settings_read_the_file_named_by_berth_access(tmp_path: Path) -> None:
    path = write(tmp_path, "teams:\n  vision: [bob]\n")
    s = BerthSettings.from_env({"BERTH_HOME": str(tmp_path), "BERTH_ACCESS": str(path)})
    access = s.access()
    assert access is not None and access.allows("bob", "vision")
    assert BerthSettings.from_env({"BERTH_HOME": str(tmp_path)}).access() is None


def test_the_user_is_who_triggered_the_run() -> None:
    assert user_of(SimpleNamespace(triggering_user_name="bob")) == "bob"
    assert user_of(SimpleNamespace(triggering_user_name=None)) is None
    assert user_of(None) is None
