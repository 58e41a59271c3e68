"""The FP8 casts of one layer of the 16-layer model, kernel by kernel, at their default blocks.

Usage (CUDA + Triton): ``python benchmarks/model_casts.py [--tokens 2048 8192] [--opening]``.

``transformer.py``'s layer (hidden 2048, ffn 8192; ``LayerNormLinear`` qkv, ``Linear``
projection, ``LayerNormMLP``) casts, per step and ``T`` tokens: three activations of ``T x
2048`` and the four weights with their transposed copies, GELU's output without one (then a
byte transpose), three output gradients with column sums and transposed copies, and GELU's
gradient with column sums (then a byte transpose). This times each such launch alone (CUDA
events, back to back, :func:`hopper.kernel_ms`) with the block shapes
:func:`fp8state._kernels.cast_launch.default_config` picks, and prints the bytes it moves per
second and the layer's and the 16 layers' sums: the casts' share of a step's GPU time,
measured without the rest of the step around them. ``--opening`` times every launch as one
that opens its step instead (shifting a 1024-row history and gathering the amax in the
history's scratch pair), as a step's first record into each history runs.
"""

from __future__ import annotations

import argparse

import torch
from hopper import kernel_ms, spin_up  # benchmarks/ is on sys.path as a script
from transformer import MODEL

from fp8state._kernels import cast_launch
from fp8state._kernels.cast_launch import default_config
from fp8state._kernels.triton_transpose import transpose_bytes

_CUDA = torch.device("cuda")


def layer_casts(tokens: int) -> list[tuple[str, int, int, str, bool, bool, int]]:
    """``(what, rows, cols, op, transpose, column sums, launches per layer)`` of one layer."""
    hidden, ffn = MODEL["hidden"], MODEL["ffn"]
    return [
        ("activation (qkv, proj, fc1 inputs)", tokens, hidden, "identity", True, False, 3),
        ("weight qkv", 3 * hidden, hidden, "identity", True, False, 1),
        ("weight proj", hidden, hidden, "identity", True, False, 1),
        ("weight fc1", ffn, hidden, "identity", True, False, 1),
        ("weight fc2", hidden, ffn, "identity", True, False, 1),
        ("GELU output (+ byte transpose)", tokens, ffn, "gelu", False, False, 1),
        ("gradient qkv", tokens, 3 * hidden, "identity", True, True, 1),
        ("gradient proj, fc2", tokens, hidden, "identity", True, True, 2),
        ("GELU gradient (+ byte transpose)", tokens, ffn, "dgelu", False, True, 1),
    ]


def cast_us(
    x: torch.Tensor,
    aux: torch.Tensor | None,
    op: str,
    transpose: bool,
    sums: bool,
    iters: int = 30,
    new_step: bool = False,
) -> float:
    """Device microseconds of one default cast of ``x``.

    A later record of a step, or with ``new_step`` one that opens it (shifting a 1024-row
    history first).
    """
    history, scale = torch.zeros(1024, 3, device=_CUDA), torch.ones(3, device=_CUDA)
    return 1e3 * kernel_ms(
        lambda: cast_launch._launch(
            x,
            scale,
            scale,
            history,
            1,
            3,
            torch.float8_e4m3fn,
            transpose,
            snapshot=True,
            new_step=new_step,
            column_sums=sums,
            op=op,
            aux=aux,
        ),
        _CUDA,
        5,
        iters,
    )


def byte_transpose_us(rows: int, cols: int) -> float:
    """Device microseconds of the byte transpose of a ``rows x cols`` FP8 tensor."""
    x8 = torch.zeros(rows, cols, device=_CUDA, dtype=torch.float8_e4m3fn)
    return 1e3 * kernel_ms(lambda: transpose_bytes(x8), _CUDA, 5, 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--opening", action="store_true", help="launches that open a step")
    args = parser.parse_args()
    spin_up(_CUDA, 3)
    for tokens in args.tokens:
        layer_us = 0.0
        for what, rows, cols, op, transpose, sums, count in layer_casts(tokens):
            x = torch.randn(rows, cols, device=_CUDA, dtype=torch.bfloat16)
            aux = torch.randn_like(x) if op == "dgelu" else None
            moved = x.numel() * (2 + (2 if aux is not None else 0) + (2 if transpose else 1))
            us = cast_us(x, aux, op, transpose, sums, new_step=args.opening)
            config = default_config(rows, cols, transpose, op, sums)
            line = f"T={tokens} {what} {rows}x{cols} {config}: {us:.1f} us, "
            line += f"{moved / us / 1e3:.0f} GB/s"
            if not transpose:  # the operand's transposed copy comes from a byte transpose
                t_us = byte_transpose_us(rows, cols)
                line += f"; byte transpose {t_us:.1f} us, {x.numel() * 2 / t_us / 1e3:.0f} GB/s"
                us += t_us
            layer_us += us * count
            print(line, flush=True)
        step_ms = layer_us * MODEL["layers"] / 1e3
        kind = " (every launch opening a step)" if args.opening else ""
        print(f"T={tokens}: one layer's casts {layer_us:.1f} us, a step's {step_ms:.2f} ms{kind}")


if __name__ == "__main__":
    main()
