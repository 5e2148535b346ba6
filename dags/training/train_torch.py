"""A real PyTorch data-parallel training job, for machines with GPUs (the numpy `train_mlp.py`
is the demo's, which runs anywhere).

It reads what every Berth runtime gives a replica (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
CUDA_VISIBLE_DEVICES, and BERTH_GPU_SHARE when replicas share a GPU), joins the gang with
torch.distributed (NCCL when each rank has a GPU of its own, gloo when ranks share one, which
NCCL refuses), and trains an MLP on a generated regression task with DistributedDataParallel in
bf16 autocast. Rank 0 prints the loss as it falls and writes `outputs/metrics.json` (first and
last loss, steps per second, the GPU's name) in the working directory. `--steps` and `--width`
size it.

Checkpoints, where the platform gives a folder that outlives an attempt (`BERTH_CHECKPOINT_DIR`):
rank 0 saves the model, the optimizer and the step every `--checkpoint-every` steps (written
whole, then renamed), and again when the gang is stopped: the platform's stop (a preemption, a
time limit) sends SIGTERM and waits its grace period, the ranks agree at the next step that one
of them was signalled (a one-element all-reduce, so none is left waiting in the gradients'),
rank 0 saves that step and all of them exit. A later attempt resumes from the last save; each
step's batch is drawn from a seed of (rank, step), so a resumed run sees the batches the
uninterrupted one would have.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

CHECKPOINT = "train_torch.pt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps; 0: only on stop")
    args = p.parse_args()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())  # finish the step, save, exit
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")  # its one visible GPU
    shared = "BERTH_GPU_SHARE" in os.environ
    backend = "nccl" if cuda and not shared else "gloo"
    if world > 1:
        dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    teacher = nn.Linear(64, 1).to(device)  # the function to learn, the same on every rank
    net = nn.Sequential(
        nn.Linear(64, args.width), nn.GELU(), nn.Linear(args.width, args.width), nn.GELU(),
        nn.Linear(args.width, 1),
    ).to(device)  # fmt: skip
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    folder = (
        Path(os.environ["BERTH_CHECKPOINT_DIR"]) if "BERTH_CHECKPOINT_DIR" in os.environ else None
    )
    start = _resume(folder, net, opt, device) if folder else 0
    if start:
        print(f"rank {rank}: resumed from the checkpoint of step {start}", flush=True)
    model = net
    if world > 1:
        model = nn.parallel.DistributedDataParallel(net, device_ids=[0] if cuda else None)
    gen = torch.Generator(device=device)
    losses: list[float] = []
    stopped_at = None
    started = time.perf_counter()
    for step in range(start, args.steps):
        if _anyone(stopping.is_set(), world, device):
            stopped_at = step
            break
        gen.manual_seed((1000 + rank) * 1_000_003 + step)  # this rank's batch of this step
        x = torch.randn(args.batch, 64, device=device, generator=gen)
        with torch.no_grad():
            y = torch.sin(teacher(x))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            losses.append(loss.item())
            if rank == 0:
                print(f"step {step} loss {losses[-1]:.5f}", flush=True)
        every = args.checkpoint_every
        if folder and rank == 0 and every > 0 and (step + 1) % every == 0:
            _save(folder, step + 1, net, opt)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    if stopped_at is not None:
        if folder and rank == 0:
            _save(folder, stopped_at, net, opt)
        print(f"rank {rank}: stopped at step {stopped_at}"
              + (", saved" if folder and rank == 0 else ""), flush=True)  # fmt: skip
    elif rank == 0:
        out = Path("outputs")
        out.mkdir(exist_ok=True)
        metrics = {
            "world_size": world,
            "backend": backend if world > 1 else None,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "resumed_from_step": start,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "steps_per_s": round((args.steps - start) / elapsed, 2),
        }
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        print(json.dumps(metrics), flush=True)
    if world > 1:
        dist.barrier()  # rank 0's save is whole before any rank's exit ends the gang
        dist.destroy_process_group()


def _anyone(flag: bool, world: int, device: torch.device) -> bool:
    """Whether any rank has the flag: every rank calls this at the same step."""
    if world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _save(folder: Path, step: int, net: nn.Module, opt: torch.optim.Optimizer) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{CHECKPOINT}.{os.getpid()}"
    torch.save({"step": step, "model": net.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, folder / CHECKPOINT)  # a reader never sees one half written


def _resume(folder: Path, net: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> int:
    path = folder / CHECKPOINT
    if not path.exists():
        return 0
    # torch 1.13's weights-only loader cannot read a float (the optimizer's learning rate);
    # 2.0 and later can. The file is this job's own checkpoint, so there 1.13 reads it whole.
    major, minor = (int(n) for n in torch.__version__.split(".")[:2])
    saved = torch.load(path, map_location=device, weights_only=(major, minor) >= (2, 0))
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return int(saved["step"])


if __name__ == "__main__":
    main()
