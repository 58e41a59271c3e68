"""Reading a DCP folder's ``.metadata``: fp8state's allow-list reader against plain pickle.

Usage: ``python benchmarks/dcp_metadata_read.py [--entries 5000]`` (CPU). Saves a folder of
``--entries`` small tensors with ``dcp.save`` and prints the median milliseconds of each
reader over ``--rounds`` reads, and the file's size. The figure in docs/migration.md comes
from the default arguments on this project's CI machine.

``pure_python_floor_ms`` is the floor of any reader that sees each opcode: CPython's own
pure-Python unpickler, unchanged and checking nothing (the C unpickler offers no hook at
``BUILD`` or where it hashes a key, so a reader that must refuse those cannot be it).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from fp8state.checkpoint.dcp_untrusted import read_untrusted_metadata


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with tempfile.TemporaryDirectory() as folder:
        state = {f"layer{i}.weight": torch.zeros(4) for i in range(args.entries)}
        dcp.save(state, checkpoint_id=folder, no_dist=True)
        path = os.path.join(folder, ".metadata")

        def plain() -> object:
            with open(path, "rb") as file:
                return pickle.load(file)

        def pure_python() -> object:
            with open(path, "rb") as file:
                return pickle._Unpickler(file).load()  # type: ignore[attr-defined]

        result = {
            "entries": args.entries,
            "metadata_bytes": os.path.getsize(path),
            "plain_pickle_ms": round(_median_ms(plain, args.rounds), 1),
            "pure_python_floor_ms": round(_median_ms(pure_python, args.rounds), 1),
            "allow_list_ms": round(
                _median_ms(lambda: read_untrusted_metadata(folder), args.rounds), 1
            ),
        }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
