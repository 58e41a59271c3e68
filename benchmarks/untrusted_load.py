"""Loading a large valid checkpoint through fp8state's hostile-input checks against PyTorch's own.

Usage: ``python benchmarks/untrusted_load.py [--tensors 1000] [--elements 262144] [--rounds 7]``
(CPU). Writes ``--tensors`` float32 tensors of ``--elements`` each twice, as a DCP folder and as
one ``torch.save`` file, and prints the median milliseconds of reading each back whole:

- ``dcp``: ``fp8state.checkpoint.load_dcp_state_dict(path)`` (the allow-list reader of
  ``.metadata``, storage and coverage checks, tensors allocated by the call) against PyTorch
  alone (``dcp.load`` into a state dict of tensors allocated beforehand, with DCP's own
  reader; ``ratio``) and against ``trusted=True`` (DCP's reader of ``.metadata`` in
  fp8state's call, as before folders were read as untrusted; ``ratio_trusted``).
- ``file``: ``fp8state.checkpoint.load(path)`` (the dry run that bounds key hashing, then
  ``torch.load``) against ``torch.load(path, weights_only=True, map_location="cpu")``.

Rounds alternate the readers, in a rotating order; the files stay in the page cache, so the
figures are the readers' cost, not the disk's. The figures in docs/security.md come from the
default arguments and from ``--elements 65536 --rounds 15`` on this project's CI machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

import fp8state


def _medians(rounds: int, *fns: Callable[[], object]) -> list[float]:
    """Median milliseconds of each of ``fns``, run in turn ``rounds`` times.

    The order rotates each round: whichever call runs first after another's gigabyte was freed
    pays for fresh pages, and that must not always be the same one.
    """
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(rounds):
        for i in range(len(fns)):
            j = (i + round_) % len(fns)
            start = time.perf_counter()
            fns[j]()
            times[j].append((time.perf_counter() - start) * 1e3)
    return [round(statistics.median(t), 1) for t in times]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--elements", type=int, default=262144)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = {f"layers.{i}.weight": torch.randn(args.elements) for i in range(args.tensors)}
    result: dict = {"tensors": args.tensors, "bytes": args.tensors * args.elements * 4}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "dcp")
        dcp.save(state, checkpoint_id=path, no_dist=True)
        template = {key: torch.empty_like(value) for key, value in state.items()}
        checked, trusted, plain = _medians(
            args.rounds,
            lambda: fp8state.checkpoint.load_dcp_state_dict(path),
            lambda: fp8state.checkpoint.load_dcp_state_dict(path, trusted=True),
            lambda: dcp.load(template, checkpoint_id=path, no_dist=True),
        )
        result["dcp"] = {"checked_ms": checked, "trusted_ms": trusted, "torch_ms": plain}
        result["dcp"]["ratio"] = round(checked / plain, 3)
        result["dcp"]["ratio_trusted"] = round(checked / trusted, 3)
        file = os.path.join(folder, "ckpt.pt")
        torch.save(state, file)
        checked, plain = _medians(
            args.rounds,
            lambda: fp8state.checkpoint.load(file),
            lambda: torch.load(file, weights_only=True, map_location="cpu"),
        )
        result["file"] = {"checked_ms": checked, "torch_ms": plain}
        result["file"]["ratio"] = round(checked / plain, 3)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
