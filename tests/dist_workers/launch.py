"""Run a function on N fresh processes (one gloo rank each) with a hard deadline.

``torch.multiprocessing.spawn`` has no timeout; a hung collective would hang the test run. Here
the processes are started with ``join=False`` and killed (by their own pids) at the deadline.
A child's exception comes back with its traceback (``ProcessRaisedException``).
"""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def init_gloo(rank: int, world: int, store_file: str) -> None:
    """Join the gloo group through a file store (no port to collide with other tests)."""
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)


def shutdown() -> None:
    """Destroy the default process group once nothing else keeps it alive.

    A DDP model's reducer holds the group; when such a model sits in a reference cycle,
    ``destroy_process_group`` does not free the group, the cyclic collector does, and if that
    happens only while the interpreter shuts down, gloo's threads are torn down then and the
    rank aborts ("terminate called without an active exception": a rare flake). Callers keep
    their models in a function of their own; this collects before destroying.
    """
    gc.collect()
    dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, args: tuple, *, timeout: float) -> None:
    """Call ``fn(rank, *args)`` in ``world`` spawned processes; raise if one fails or hangs."""
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks of {fn.__name__} ran past {timeout:.0f} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def store_path(folder: str, name: str) -> str:
    """A fresh file-store path (the file must not exist before the group starts)."""
    path = os.path.join(folder, f"store-{name}")
    if os.path.exists(path):
        os.remove(path)
    return path


def free_port() -> int:
    """A TCP port free on this host now, for a group started through ``MASTER_PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
