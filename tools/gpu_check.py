"""Berth on a machine with NVIDIA GPUs, end to end without Airflow: the local inventory reads
the GPUs from nvidia-smi, the engine places a two-replica gang on them (a GPU each where there
are two or more, halves of one GPU where there is one), and the local runtime runs a real
PyTorch data-parallel training job there (`dags/training/train_torch.py`) until it ends.

With `--preempt`, a second job shows what a preemption costs with checkpoints: its attempt 1
is stopped the way the platform stops a victim (SIGTERM, then the grace period) once it has run
past a periodic checkpoint; the ranks save the step they reached and exit; attempt 2 resumes
from that save. The report gives the step stopped at, the step resumed from (equal when nothing
was lost) and the step the last periodic checkpoint alone would have resumed from.

For the GPU machines a session is sometimes lent (no Airflow or MLflow there, and no network:
what the demo needs cannot be installed). Prints what it saw as JSON; exits 1 if the job
failed. Run: python tools/gpu_check.py [--root DIR] [--steps N] [--width W] [--preempt]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from berth.runtime.inventory import detect_gpus, local_cluster  # noqa: E402
from berth.runtime.local import LocalRuntime  # noqa: E402
from scheduling.config import parse_teams  # noqa: E402
from scheduling.cycle import schedule  # noqa: E402
from scheduling.jobs import Job  # noqa: E402
from scheduling.policy import BERTH  # noqa: E402
from scheduling.state import EngineState  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=None, help="where attempts go (a temp folder)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=2048, help="the model's hidden width")
    p.add_argument("--preempt", action="store_true", help="also stop a job and resume it")
    args = p.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="berth-gpu-check-"))
    gpus = detect_gpus()
    cluster = local_cluster(None)
    node = cluster.nodes[0]
    teams = parse_teams([{"name": "ml", "nominal": {"gpus": node.gpus}}])
    state = EngineState(cluster, teams, BERTH)
    per_replica = 1000 if node.gpus >= 2 else 500  # milli-GPUs: halves of a single GPU
    job = Job("gpu-check", "ml", replicas=2, gpu=per_replica)
    state.submit(job, 0.0)
    result = schedule(state.snapshot(0.0), BERTH)
    if not result.admitted:
        print(json.dumps({"admitted": False, "reason": str(result.pending.get(job.id))}))
        return 1
    placement = result.admitted[0].placement
    runtime = LocalRuntime(root / "attempts")
    script = ROOT / "dags" / "training" / "train_torch.py"
    command = [sys.executable, str(script), "--width", str(args.width)]
    run = _attempt(runtime, job.id, 1, [*command, "--steps", str(args.steps)], placement,
                   cluster, root / "work")  # fmt: skip
    report: dict[str, Any] = {
        "gpus_detected": [[g.index, g.name, g.memory_mib] for g in gpus or []],
        "node": {"name": node.name, "gpus": node.gpus, "model": node.gpu_model},
        "placement": [{"gpus": list(r.gpus), "share": r.share / 1000} for r in placement.replicas],
        **{k: v for k, v in run.items() if k != "log"},
    }
    ok = run["state"] == "succeeded"
    if args.preempt:
        report["preempted"] = _preempted(runtime, command, placement, cluster, root)
        ok = ok and report["preempted"]["lost_steps"] == 0
    print(json.dumps(report, indent=1, default=str))
    return 0 if ok else 1


def _attempt(
    runtime: LocalRuntime,
    job_id: str,
    attempt: int,
    command: list[str],
    placement: Any,
    cluster: Any,
    workdir: Path,
    stop_after_line: str | None = None,
) -> dict[str, Any]:
    """Launches one attempt and polls it to its end; with `stop_after_line`, stops it (SIGTERM,
    then 60 s of grace) once a line of its log holds that text."""
    started = time.time()
    launch = runtime.launch(job_id, attempt, command, placement, cluster, env={}, workdir=workdir)
    lines: list[str] = []
    cursor = None
    status = runtime.poll(launch)
    while status.state == "running":
        time.sleep(0.2)
        new, cursor = runtime.logs(launch, cursor)
        lines += new
        if stop_after_line and any(stop_after_line in line for line in new):
            runtime.stop(launch, grace_s=60.0)
        status = runtime.poll(launch)
    new, cursor = runtime.logs(launch, cursor)
    lines += new
    metrics_file = workdir / "outputs" / "metrics.json"
    return {
        "state": status.state,
        "message": status.message,
        "seconds": round(time.time() - started, 1),
        "metrics": json.loads(metrics_file.read_text()) if metrics_file.exists() else None,
        "log_tail": lines[-12:],
        "log": lines,
    }


def _preempted(
    runtime: LocalRuntime, command: list[str], placement: Any, cluster: Any, root: Path
) -> dict[str, Any]:
    steps, every = 2000, 100
    argv = [*command, "--steps", str(steps), "--checkpoint-every", str(every)]
    first = _attempt(runtime, "gpu-check-preempted", 1, argv, placement, cluster,
                     root / "work-preempted", stop_after_line="step 250 ")  # fmt: skip
    stopped = _step_of(first["log"], r"rank 0: stopped at step (\d+), saved")
    second = _attempt(runtime, "gpu-check-preempted", 2, argv, placement, cluster,
                      root / "work-preempted")  # fmt: skip
    resumed = _step_of(second["log"], r"rank 0: resumed from the checkpoint of step (\d+)")
    return {
        "attempt_1": {k: first[k] for k in ("state", "seconds", "log_tail")},
        "attempt_2": {k: second[k] for k in ("state", "seconds", "metrics", "log_tail")},
        "stopped_at_step": stopped,
        "resumed_from_step": resumed,
        "periodic_checkpoint_only_would_resume_from": (stopped // every) * every
        if stopped is not None
        else None,
        "lost_steps": stopped - resumed
        if stopped is not None and resumed is not None and second["state"] == "succeeded"
        else None,
    }


def _step_of(lines: list[str], pattern: str) -> int | None:
    found = [int(m.group(1)) for line in lines if (m := re.search(pattern, line))]
    return found[-1] if found else None


if __name__ == "__main__":
    sys.exit(main())
