"""What is alive at the peak of one LayerNormMLP fwd+bwd step, and where it was allocated.

Usage (CUDA): ``python benchmarks/peak_memory.py [--shape 16384x4096x16384]`` (tokens x hidden
x ffn). Records the CUDA caching allocator's history over one step after a warm-up step
(``torch.cuda.memory._record_memory_history``), replays its allocations and frees, and prints
the peak above the memory held before the step (the figure hopper.py compares with bf16) and
the largest blocks alive at that moment with the fp8state lines that allocated them.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from hopper import fwd_bwd  # the benchmark's step (benchmarks/ is on sys.path)

import fp8state


def _where(event: dict[str, Any]) -> str:
    frames = [f for f in event.get("frames", []) if "fp8state" in f["filename"]]
    return (
        " <- ".join(
            f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in frames[:3]
        )
        or "(outside fp8state)"
    )


def peak_blocks(events: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """Replay allocator events: the peak of bytes allocated during them, and the blocks then."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, at_peak = total, list(live.values())
    return peak, sorted(at_peak, key=lambda e: -e["size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384x4096x16384")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    tokens, hidden, ffn = map(int, args.shape.split("x"))
    mlp = fp8state.LayerNormMLP(hidden, ffn, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step = fwd_bwd(mlp, x, torch.randn_like(x), True)
    step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = peak_blocks(snapshot["device_traces"][torch.cuda.current_device()])
    print(f"peak above the memory held before the step: {peak / 2**20:.1f} MiB")
    for block in blocks[: args.top]:
        print(f"{block['size'] / 2**20:8.1f} MiB  {_where(block)}")


if __name__ == "__main__":
    main()
