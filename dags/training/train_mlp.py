"""A real, small training job for the demo: a numpy MLP on a generated two-class data set.

Data parallel like torch.distributed, without torch: RANK and WORLD_SIZE pick this replica's
shard; after every epoch the ranks average their weights through rank 0 over
MASTER_ADDR:MASTER_PORT (local SGD with model averaging), so the gang really is a gang: a rank
that cannot reach the others fails the job. Rank 0 writes `outputs/model.npz` and
`outputs/metrics.json` in the working directory.

Data: `--data PATH` (default: `$BERTH_INPUT_0`, the staged input; with neither, it generates
one) is an .npz with `x` and `y`; `--make-data PATH` writes one (the pipeline's prepare step).
`--fail-on-attempt N` exits 3 when BERTH_ATTEMPT is N, after the first epoch, to show a retry.

Checkpoints: where the platform gives a place that outlives an attempt (`BERTH_CHECKPOINT_DIR`),
rank 0 saves the averaged weights and the epoch there after every `--checkpoint-every` epochs
(written whole, then renamed), and every rank of a later attempt (a retry, or a restart after a
preemption) resumes from the last one instead of from scratch.

Tracking is plain MLflow: when the platform tracks the attempt it sets MLFLOW_TRACKING_URI and
MLFLOW_RUN_ID, `mlflow.start_run()` resumes that run, and rank 0 logs the metrics and the
model file (every rank's system metrics go there too, told apart by node id).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

import numpy as np

AUTH = b"berth-demo"


def make_data(path: Path, n: int = 2000, seed: int = 0) -> None:
    """Two interleaved half-moons with noise: not linearly separable, an MLP learns it."""
    rng = np.random.default_rng(seed)
    t = rng.uniform(0, np.pi, n)
    label = rng.integers(0, 2, n)
    x = np.stack([np.cos(t) + label * 1.0, np.sin(t) * (1 - 2 * label) + label * 0.5], axis=1)
    x += rng.normal(0, 0.15, x.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every rank of a gang without input writes the same file in the shared working folder:
    # written whole elsewhere, then renamed, a rank never reads one half written (it did once).
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
    np.savez(tmp, x=x.astype(np.float32), y=label.astype(np.float32))
    os.replace(tmp, path)


def init(hidden: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0, 1.0, (2, hidden)),
        "b1": np.zeros(hidden),
        "w2": rng.normal(0, 1.0 / np.sqrt(hidden), (hidden, 1)),
        "b2": np.zeros(1),
    }


def forward(p: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.tanh(x @ p["w1"] + p["b1"])
    return h, 1 / (1 + np.exp(-(h @ p["w2"] + p["b2"])[:, 0]))


def sgd_epoch(p: dict, x: np.ndarray, y: np.ndarray, lr: float, rng: np.random.Generator) -> None:
    for idx in np.array_split(rng.permutation(len(x)), max(1, len(x) // 32)):
        xb, yb = x[idx], y[idx]
        h, prob = forward(p, xb)
        d = (prob - yb)[:, None] / len(xb)
        dh = (d @ p["w2"].T) * (1 - h**2)
        p["w2"] -= lr * h.T @ d
        p["b2"] -= lr * d.sum(0)
        p["w1"] -= lr * xb.T @ dh
        p["b1"] -= lr * dh.sum(0)


def evaluate(p: dict, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    _, prob = forward(p, x)
    eps = 1e-7
    loss = -np.mean(y * np.log(prob + eps) + (1 - y) * np.log(1 - prob + eps))
    return {"loss": float(loss), "accuracy": float(np.mean((prob > 0.5) == y))}


CHECKPOINT = "mlp.npz"


def save_checkpoint(folder: Path, epoch: int, params: dict[str, np.ndarray]) -> None:
    tmp = folder / f".{CHECKPOINT}.{os.getpid()}.npz"
    np.savez(tmp, epoch=np.array(epoch), **params)
    os.replace(tmp, folder / CHECKPOINT)  # a reader never sees one half written


def load_checkpoint(folder: Path) -> tuple[int, dict[str, np.ndarray]] | None:
    path = folder / CHECKPOINT
    if not path.exists():
        return None
    with np.load(path) as saved:
        return int(saved["epoch"]), {k: saved[k] for k in saved.files if k != "epoch"}


class Gang:
    """Weight averaging across ranks; rank 0 hosts, the others connect (with a deadline)."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout_s: float = 60):
        self.rank, self.world, self.peers = rank, world, []
        if world == 1:
            return
        if rank == 0:
            listener = Listener((addr, port), authkey=AUTH)
            self.peers = [listener.accept() for _ in range(world - 1)]
            listener.close()
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    self.peers = [Client((addr, port), authkey=AUTH)]
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(
                            f"rank {rank}: rank 0 not reachable at {addr}:{port}"
                        ) from None
                    time.sleep(0.1)  # rank 0 is still starting its listener

    def average(self, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.world == 1:
            return p
        if self.rank == 0:
            got = [p] + [c.recv() for c in self.peers]
            avg = {k: sum(g[k] for g in got) / self.world for k in p}
            for c in self.peers:
                c.send(avg)
            return avg
        self.peers[0].send(p)
        return self.peers[0].recv()


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--data", default=os.environ.get("BERTH_INPUT_0"))
    a.add_argument("--make-data")
    a.add_argument("--epochs", type=int, default=20)
    a.add_argument("--hidden", type=int, default=16)
    a.add_argument("--lr", type=float, default=0.5)
    a.add_argument("--out", default="outputs")
    a.add_argument("--fail-on-attempt", type=int, default=0)
    a.add_argument("--checkpoint-every", type=int, default=1, help="epochs; 0: never")
    args = a.parse_args(argv)
    if args.make_data:
        make_data(Path(args.make_data))
        print(f"wrote {args.make_data}")
        return 0
    if not args.data:  # launched from the form with no input: generate the data set here
        args.data = "data.npz"
        make_data(Path(args.data))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    attempt = int(os.environ.get("BERTH_ATTEMPT", 1))
    print(f"rank {rank}/{world} attempt {attempt} GPUs={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    data = np.load(args.data)
    x, y = data["x"].astype(np.float64), data["y"].astype(np.float64)
    n_test = len(x) // 5
    x_test, y_test, x_train, y_train = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    shard = slice(rank, None, world)  # this rank's share of the training set
    gang = Gang(rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                int(os.environ.get("MASTER_PORT", 29500)))  # fmt: skip
    params, done = init(args.hidden, seed=0), 0
    checkpoints = os.environ.get("BERTH_CHECKPOINT_DIR")
    folder = Path(checkpoints) if checkpoints and args.checkpoint_every > 0 else None
    saved = load_checkpoint(folder) if folder else None
    if saved is not None:
        done, params = saved
        print(f"rank {rank}: resumed from the checkpoint of epoch {done}", flush=True)
    rng = np.random.default_rng((rank, done))  # each rank its own order, per restart too
    tracking = None
    if os.environ.get("MLFLOW_RUN_ID"):  # the platform tracks this attempt
        import mlflow

        tracking = mlflow
        mlflow.start_run()  # resumes MLFLOW_RUN_ID
        if rank == 0:
            mlflow.log_params({"epochs": args.epochs, "hidden": args.hidden, "lr": args.lr})
    report_every = max(1, args.epochs // 50)  # about 50 lines and metric points per run
    try:
        for epoch in range(done + 1, args.epochs + 1):
            sgd_epoch(params, x_train[shard], y_train[shard], args.lr, rng)
            params = gang.average(params)
            if folder and rank == 0 and epoch % args.checkpoint_every == 0:
                save_checkpoint(folder, epoch, params)
            if rank == 0 and (epoch % report_every == 0 or epoch == args.epochs):
                scores = evaluate(params, x_test, y_test)
                print(f"epoch {epoch} " + json.dumps(scores), flush=True)
                if tracking:
                    tracking.log_metrics(scores, step=epoch)
            if epoch == done + 1 and args.fail_on_attempt == attempt:
                print(f"rank {rank}: failing on attempt {attempt} as asked", file=sys.stderr)
                return 3
        if rank == 0:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            np.savez(out / "model.npz", **params)
            metrics = {**evaluate(params, x_test, y_test), "epochs": args.epochs, "world": world}
            (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
            print("metrics " + json.dumps(metrics))
            if tracking:
                tracking.log_artifact(str(out / "model.npz"), artifact_path="model")
        return 0
    finally:
        if tracking:
            tracking.end_run()


if __name__ == "__main__":
    sys.exit(main())
