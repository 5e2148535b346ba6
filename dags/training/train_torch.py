"""A real PyTorch data-parallel training job, for machines with GPUs (the numpy `train_mlp.py`
is the demo's, which runs anywhere).

It reads what every Berth runtime gives a replica (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
CUDA_VISIBLE_DEVICES, and BERTH_GPU_SHARE when replicas share a GPU), joins the gang with
torch.distributed (NCCL when each rank has a GPU of its own, gloo when ranks share one, which
NCCL refuses), and trains an MLP on a generated regression task with DistributedDataParallel in
bf16 autocast. Rank 0 prints the loss as it falls and writes `outputs/metrics.json` (first and
last loss, steps per second, the GPU's name) in the working directory. `--steps` and `--width`
size it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1024)
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")  # its one visible GPU
    shared = "BERTH_GPU_SHARE" in os.environ
    backend = "nccl" if cuda and not shared else "gloo"
    if world > 1:
        dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    teacher = nn.Linear(64, 1).to(device)  # the function to learn, the same on every rank
    model = nn.Sequential(
        nn.Linear(64, args.width), nn.GELU(), nn.Linear(args.width, args.width), nn.GELU(),
        nn.Linear(args.width, 1),
    ).to(device)  # fmt: skip
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[0] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own shard
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(args.steps):
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
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    if rank == 0:
        out = Path("outputs")
        out.mkdir(exist_ok=True)
        metrics = {
            "world_size": world,
            "backend": backend if world > 1 else None,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "steps_per_s": round(args.steps / elapsed, 2),
        }
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        print(json.dumps(metrics), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
