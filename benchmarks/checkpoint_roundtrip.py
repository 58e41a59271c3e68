"""A whole model's checkpoint round trip: fp8state modules against the same model in torch.nn.

Usage (on an H200; the recorded figure is ``checkpoint_roundtrip`` in
benchmarks/results/h200.json)::

    python benchmarks/checkpoint_roundtrip.py --out benchmarks/results/h200.json

One round is what a user's save and resume do: ``model.state_dict()``, ``torch.save`` to a
file, ``torch.load(path, weights_only=True)`` and ``model.load_state_dict``. The model is
``--layers`` transformer-sized blocks of hidden ``--hidden``: a ``LayerNormLinear`` (qkv), a
``Linear`` (projection) and a ``LayerNormMLP`` (ffn 4x), after one FP8 step so the metadata is
real; the baseline is the same blocks built from ``nn.LayerNorm``, ``nn.Linear`` and
``nn.GELU``, the same parameters in the same dtype. Rounds alternate between the two models
(medians); the ratio is ``fp8state time / torch.nn time``. ``--out`` merges the one key into
an existing JSON file. ``--quick`` (a tiny model, on CPU too) tests the script.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from record import report  # benchmarks/ is on sys.path as a script
from torch import nn

import fp8state

KEY = "checkpoint_roundtrip"


def fp8_model(layers: int, hidden: int, device: torch.device) -> nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [
            fp8state.LayerNormLinear(hidden, 3 * hidden, device=device),
            fp8state.Linear(hidden, hidden, device=device),
            fp8state.LayerNormMLP(hidden, 4 * hidden, device=device),
        ]
    return nn.ModuleList(blocks)


def plain_model(layers: int, hidden: int, device: torch.device) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden)),
            nn.Linear(hidden, hidden),
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, 4 * hidden),
                nn.GELU(),
                nn.Linear(4 * hidden, hidden),
            ),
        ]
    return nn.ModuleList(blocks).to(device)


def one_fp8_step(model: nn.Module, hidden: int, device: torch.device) -> None:
    """One forward and backward in FP8 (16 tokens), so every history and scale is real."""
    for module in model.modules():
        if isinstance(module, fp8state.FP8StateMixin):
            module.fp8_min_gemm_macs = 0
    x = torch.randn(16, hidden, device=device)
    with fp8state.fp8_autocast():
        for i in range(0, len(model), 3):
            qkv = model[i](x)
            x = x + model[i + 1](qkv[:, :hidden])
            x = x + model[i + 2](x)
    x.float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)


def round_trip_ms(model: nn.Module, path: Path, device: torch.device) -> float:
    """Milliseconds of state_dict, torch.save, torch.load(weights_only=True), load_state_dict."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    torch.save(model.state_dict(), path)
    model.load_state_dict(torch.load(path, weights_only=True))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = (time.perf_counter() - start) * 1e3
    path.unlink()
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    """Measure both models; print (and merge into ``--out``) the one JSON key."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a tiny model, to test the script")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.rounds = 2, 32, 2
    device = torch.device(args.device)
    fp8 = fp8_model(args.layers, args.hidden, device)
    one_fp8_step(fp8, args.hidden, device)
    plain = plain_model(args.layers, args.hidden, device)
    params = sum(p.numel() for p in plain.parameters())
    assert params == sum(p.numel() for p in fp8.parameters()), "the two models differ"
    times: dict[str, list[float]] = {"fp8state": [], "torch_nn": []}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "checkpoint.pt"
        round_trip_ms(fp8, path, device)  # warm-up: allocator, page cache, lazy imports
        round_trip_ms(plain, path, device)
        for _ in range(args.rounds):
            times["fp8state"].append(round_trip_ms(fp8, path, device))
            times["torch_nn"].append(round_trip_ms(plain, path, device))
    fp8_ms, plain_ms = (statistics.median(times[k]) for k in ("fp8state", "torch_nn"))
    result = {
        "ratio": round(fp8_ms / plain_ms, 3),
        "fp8state_ms": round(fp8_ms, 1),
        "torch_nn_ms": round(plain_ms, 1),
        "rounds": times,
        "layers": args.layers,
        "hidden": args.hidden,
        "parameters": params,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
        "command": "python benchmarks/checkpoint_roundtrip.py" + (" --quick" if args.quick else ""),
    }
    report({KEY: result}, args.out)
    return result


if __name__ == "__main__":
    main()
