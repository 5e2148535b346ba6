"""Berth on a machine with NVIDIA GPUs, end to end without Airflow: the local inventory reads
the GPUs from nvidia-smi, the engine places a two-replica gang on them (a GPU each where there
are two or more, halves of one GPU where there is one), and the local runtime runs a real
PyTorch data-parallel training job there (`dags/training/train_torch.py`) until it ends.

For the GPU machines a session is sometimes lent (no Airflow or MLflow there, and no network:
what the demo needs cannot be installed). Prints what it saw as JSON; exits 1 if the job
failed. Run: python tools/gpu_check.py [--root DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

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
    command = [sys.executable, str(ROOT / "dags" / "training" / "train_torch.py")]
    started = time.time()
    launch = runtime.launch(
        job.id,
        1,
        [*command, "--steps", str(args.steps)],
        placement,
        cluster,
        env={},
        workdir=root / "work",
    )
    status = runtime.poll(launch)
    while status.state == "running":
        time.sleep(0.5)
        status = runtime.poll(launch)
    lines, _ = runtime.logs(launch)
    metrics_file = root / "work" / "outputs" / "metrics.json"
    report = {
        "gpus_detected": [[g.index, g.name, g.memory_mib] for g in gpus or []],
        "node": {"name": node.name, "gpus": node.gpus, "model": node.gpu_model},
        "placement": [{"gpus": list(r.gpus), "share": r.share / 1000} for r in placement.replicas],
        "state": status.state,
        "message": status.message,
        "seconds": round(time.time() - started, 1),
        "metrics": json.loads(metrics_file.read_text()) if metrics_file.exists() else None,
        "log_tail": lines[-12:],
    }
    print(json.dumps(report, indent=1, default=str))
    return 0 if status.state == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
