"""Save with torch.distributed.checkpoint on 2 ranks, load in 1 process, consolidate to 1 file.

Run: python examples/dcp_two_ranks.py

The script starts two CPU processes (gloo). They train a DDP model of fp8state modules for a
few FP8 steps on different data; fp8_autocast reduces the amaxes across ranks, so both hold the
same FP8 metadata, which ``dcp_save`` checks before writing the folder. Then this process, with
no process group at all, loads the folder into a fresh model (``dcp_load``), and turns it into a
single ``torch.save`` file that plain ``torch.load(weights_only=True)`` reads (``consolidate``).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fp8state
from fp8state.checkpoint import consolidate, dcp_load, dcp_save

WORLD, HIDDEN, STEPS = 2, 32, 4


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        fp8state.LayerNormLinear(HIDDEN, HIDDEN), nn.GELU(), fp8state.Linear(HIDDEN, 1)
    )


def train_and_save(rank: int, folder: str) -> None:
    """One rank's work: train with DDP in FP8, then save collectively with DCP."""
    model = nn.parallel.DistributedDataParallel(build_model(seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)  # each rank its own data
    for _ in range(STEPS):
        x = torch.randn(16, HIDDEN, generator=gen) * (rank + 1)
        with fp8state.fp8_autocast():  # amaxes reduced over the default group
            loss = F.mse_loss(model(x), x.mean(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Collective: every rank calls it. Keys are the plain model's (no DDP "module.").
    dcp_save(model, Path(folder) / "dcp")
    if rank == 0:  # what the loaders below must reproduce
        torch.save(model.module.state_dict(), Path(folder) / "reference.pt")


def rank_main(rank: int, port: int, folder: str) -> None:
    """Entry point of each spawned process."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # In its own function, so the DDP model is gone before its process group is: a DDP
        # reducer outliving destroy_process_group() can hang the process at exit.
        train_and_save(rank, folder)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def same_state(model: nn.Module, reference: dict) -> bool:
    """Every weight and every FP8 metadata tensor equals the reference bit for bit."""
    state = model.state_dict()
    if state.keys() != reference.keys():
        return False
    # An FP8 module's _extra_state is one float32 tensor, compared like any weight.
    return all(torch.equal(value, state[key]) for key, value in reference.items())


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(free_port(), folder), nprocs=WORLD, join=True)
        reference = torch.load(Path(folder) / "reference.pt", weights_only=True)
        print(
            f"{WORLD} ranks trained {STEPS} FP8 steps and saved {Path(folder, 'dcp').name}/ "
            f"({len(os.listdir(Path(folder) / 'dcp'))} files)"
        )

        # One process, no process group: load the 2-rank checkpoint into a fresh model.
        loaded = build_model(seed=1)  # other initial weights: everything must come from disk
        dcp_load(loaded, Path(folder) / "dcp")
        loaded_ok = same_state(loaded, reference)
        print(f"dcp_load into 1 process: identical to rank 0's model: {loaded_ok}")

        # Or turn the folder into one ordinary file.
        result = consolidate(Path(folder) / "dcp", Path(folder) / "model.pt")
        from_file = build_model(seed=2)
        from_file.load_state_dict(torch.load(result.path, weights_only=True))
        file_ok = same_state(from_file, reference)
        print(
            f"consolidate: {result.num_tensors} tensors, FP8 modules "
            f"{sorted(result.fp8_modules)}; torch.load(weights_only=True) gives the same "
            f"model: {file_ok}"
        )
    head = loaded[2].fp8_meta("fwd")
    print(f"head forward scales (reduced over both ranks): {head.scale.tolist()}")
    return 0 if loaded_ok and file_ok else 1


if __name__ == "__main__":
    sys.exit(main())
