"""The layers hold by a check that fails: `lint-imports` (pyproject.toml's contracts) on a copy
of the tree breaks when the engine imports an I/O library or the platform, the platform
imports Airflow, or the Airflow plugin and the operators import each other, and passes on the
tree as it is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("scheduling", "berth", "operators", "plugins", "dags")
LAYERS = "Layers: dags -> operators -> berth -> scheduling"
ENGINE = "The engine does no I/O and knows no Airflow"
PLATFORM = "The platform never imports Airflow"
BASELINE = "The production cycle and the store run no baseline"


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for name in PACKAGES:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    # The copy is found first on the path (not the editable install of the repository).
    env = {"PYTHONPATH": str(root), "PATH": str(LINT.parent)}
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_tree_keeps_every_contract(tree: Path) -> None:
    done = lint(tree)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 4 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("scheduling/cycle.py", "import sqlalchemy", [ENGINE]),
        ("scheduling/simulator/sim.py", "import typer", [ENGINE]),
        ("berth/spec.py", "import airflow", [PLATFORM]),
        # operators.run imports Airflow: the platform now does too, through it.
        ("berth/store/store.py", "import operators.run", [LAYERS, PLATFORM]),
        ("operators/run.py", "import dags.berth_job", [LAYERS]),
        # The Airflow plugin sits beside the operators: neither imports the other.
        ("plugins/berth_api/routes.py", "import operators.run", [LAYERS]),
        ("operators/run.py", "import plugins.berth_api.routes", [LAYERS]),
        # berth would reach Airflow through the plugin too.
        ("berth/store/store.py", "import plugins.berth_api.routes", [LAYERS, PLATFORM]),
        ("scheduling/cycle.py", "import scheduling.simulator.baselines", [BASELINE]),
        ("berth/store/apply.py", "import scheduling.simulator.sim", [BASELINE]),
    ],
)
def test_a_forbidden_import_breaks_the_build(
    tree: Path, module: str, line: str, broken: list[str]
) -> None:
    path = tree / module
    before = path.read_text()
    try:
        path.write_text(before + f"\n{line}  # noqa\n")
        done = lint(tree)
    finally:
        path.write_text(before)
    assert done.returncode != 0
    verdicts = [ln for ln in done.stdout.splitlines() if ln.endswith((" KEPT", " BROKEN"))]
    assert [v.removesuffix(" BROKEN") for v in verdicts if v.endswith("BROKEN")] == broken, (
        done.stdout
    )
