"""The PyTorch data-parallel example (dags/training/train_torch.py) stopped as the platform stops
a preemption victim, and resumed: nothing lost, and the same model as a run never stopped.

Needs PyTorch, which the project does not install (a training job brings its own): the example
runs under an interpreter that has it (tests/torch_python.py: this one, or the system's with
Debian's `python3-torch`, which `.ci/run` installs). On the CPU that is two ranks over gloo; on a
machine with a GPU, two ranks sharing it (also gloo). Skipped without torch, failed in CI.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from builders import cluster
from torch_python import torch_python
from waiting import wait_for

from berth.runtime import GangStatus, LocalLaunch, LocalRuntime
from scheduling.jobs import Placement, ReplicaPlacement

PYTHON = torch_python()  # skips the module (fails in CI) without one

SCRIPT = Path(__file__).resolve().parent.parent / "dags" / "training" / "train_torch.py"
# Small enough for two CPU ranks. Halves of GPU 0, so that the ranks agree on gloo wherever
# they run: on the CPU, or both on a machine's one GPU (NCCL refuses two ranks on one GPU).
ARGS = ["--steps", "400", "--width", "64", "--batch", "64", "--checkpoint-every", "100"]
GANG = Placement(
    (ReplicaPlacement(0, (0,), share=500), ReplicaPlacement(0, (0,), share=500)), "node"
)


def _run(rt: LocalRuntime, job: str, attempt: int, work: Path, stop_at: str | None) -> list[str]:
    """One attempt to its end, its log lines; stopped (SIGTERM, grace) once a line has
    `stop_at`."""
    launch: LocalLaunch = rt.launch(
        job, attempt, [PYTHON, str(SCRIPT), *ARGS], GANG, cluster(nodes=1, gpus=2),
        env={}, workdir=work,
    )  # fmt: skip
    lines, cursor = [], None
    deadline = time.monotonic() + 300
    while (status := rt.poll(launch)).state == "running" and time.monotonic() < deadline:
        new, cursor = rt.logs(launch, cursor)
        lines += new
        if stop_at and any(stop_at in line for line in new):
            rt.stop(launch, grace_s=60.0)
        time.sleep(0.1)
    status = wait_for(lambda: (s := rt.poll(launch)).state != "running" and s, "the gang to end")
    assert isinstance(status, GangStatus)
    lines += rt.logs(launch, cursor)[0]
    assert status.state == ("stopped" if stop_at else "succeeded"), (status, lines[-20:])
    return lines


def _last(lines: list[str], pattern: str) -> str:
    found = [m.group(1) for line in lines if (m := re.search(pattern, line))]
    assert found, f"no line matches {pattern!r}: {lines[-20:]}"
    return found[-1]


def test_a_stopped_gang_saves_where_it_stopped_and_resumes_to_the_same_model(
    tmp_path: Path,
) -> None:
    rt = LocalRuntime(tmp_path / "runtime", grace_s=10.0)
    stopped = _run(rt, "resumed", 1, tmp_path / "a", stop_at="step 150 ")
    at = int(_last(stopped, r"\[rank 0\] rank 0: stopped at step (\d+), saved"))
    assert 150 < at < 400, at  # past the checkpoint of step 100: a periodic one alone loses work
    assert f"[rank 1] rank 1: stopped at step {at}" in stopped

    resumed = _run(rt, "resumed", 2, tmp_path / "a", stop_at=None)
    assert (
        int(_last(resumed, r"\[rank 0\] rank 0: resumed from the checkpoint of step (\d+)")) == at
    )
    assert (
        int(_last(resumed, r"\[rank 1\] rank 1: resumed from the checkpoint of step (\d+)")) == at
    )
    metrics = json.loads((tmp_path / "a" / "outputs" / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == at

    whole = _run(rt, "whole", 1, tmp_path / "b", stop_at=None)
    reference = json.loads((tmp_path / "b" / "outputs" / "metrics.json").read_text())
    assert reference["resumed_from_step"] == 0
    # The same batches in the same order from the same weights and optimizer state: the same
    # final loss as the run never stopped (printed to 5 decimals by both).
    final = r"\[rank 0\] step 399 loss ([0-9.]+)"
    assert _last(resumed, final) == _last(whole, final)
