"""The cast kernel's PTX for sm_90, compiled without a GPU: to check that two sources agree.

Usage (Triton installed; no GPU needed)::

    python benchmarks/cast_ptx.py [--source DIR] [--stages none|3|absent] [--order]

Compiles :func:`fp8state._kernels.triton_cast.cast_kernel` from ``--source`` (a directory
holding an ``fp8state`` package; default: this checkout) for compute capability 9.0, for a
few launch kinds of the 16-layer model's step (GELU's gradient and an output gradient with
column sums, a weight's cast with its transposed copy, GELU's cast) at the source's own
default blocks (its ``default_config``), with pointers and sizes specialized as the launcher
specializes them (16-byte aligned, multiples of 16) and line information off. Prints a hash
of each PTX and how many asynchronous copy groups it commits (loads issued ahead).
``--stages`` is the kernel's ``STAGES`` argument (``absent`` for a kernel from before it had
one). Equal hashes mean the same machine code: a change that keeps them is tested by
whatever tested the other source on a GPU. ``--order`` prints, per launch kind (and for two
launches of the norm cast kernel that open a step, which record their amax alike), the PTX lines
of its atomics, barriers and loads past L1 in program order, each atomic after the lines that
compute its predicate from ``%tid.x`` (which thread issues it): what the memory-order comments
of :mod:`fp8state._kernels.triton_record` rest on (a relaxed maximum, then a barrier, then the
acq_rel count, on the same thread).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

_POINTERS = {
    "x_ptr": "*bf16",
    "aux_ptr": "*bf16",
    "out_ptr": "*fp8e5",
    "out_t_ptr": "*fp8e5",
    "scale_ptr": "*fp32",
    "inv_ptr": "*fp32",
    "inv_out_ptr": "*fp32",
    "hist_ptr": "*fp32",
    "scratch_ptr": "*i32",
    "sums_ptr": "*fp32",
    "partial_ptr": "*fp32",
    "count_ptr": "*i32",
}
_SCALARS = {n: "i32" for n in ("slot", "n_slots", "hist_rows", "M", "N", "span", "grid_m")}
_SCALARS["fp8_max"] = "fp32"
_ALIGNED = [*_POINTERS, "M", "N", "span"]  # what the launcher's key finds 16-aligned here
_COMMON = {"SNAPSHOT": True, "SLOTS": 2, "CHUNK": 1024, "CLAMP": False}
# (rows, cols, transpose, op, column sums, opens a step) per launch kind of the model's step;
# the blocks and warps are the source's own default_config for them.
CASES = {
    "dgelu_column_sums": (2048, 8192, False, "dgelu", True, False),
    "gradient_transposed_sums_opening": (2048, 2048, True, "identity", True, True),
    "weight_transposed": (6144, 2048, True, "identity", False, False),
    "gelu_opening": (2048, 8192, False, "gelu", False, True),
}


def _kernel_module(source: Path, name: str) -> Any:
    """``fp8state._kernels.<name>`` imported from ``source`` (checked: not another copy)."""
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # paths and lines are not machine code
    if str(source) not in sys.path:
        sys.path.insert(0, str(source))
    module = importlib.import_module(f"fp8state._kernels.{name}")
    if not Path(module.__file__ or "").resolve().is_relative_to(source.resolve()):
        raise SystemExit(f"imported {module.__file__}, not the kernel under {source}")
    return module


def _sm90_ptx(kernel: Any, signature: dict, constexprs: dict, attrs: dict, warps: int) -> str:
    """The PTX Triton compiles ``kernel`` to for compute capability 9.0."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton_compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    return compiled.asm["ptx"]


def compile_ptx(source: Path, stages: str) -> dict[str, str]:
    """``{case: PTX}`` of ``source``'s cast kernel for each launch kind in ``CASES``."""
    module = _kernel_module(source, "triton_cast")
    default_config = _kernel_module(source, "cast_launch").default_config
    kernel = module.cast_kernel
    names = kernel.arg_names
    signature = {n: _POINTERS.get(n) or _SCALARS.get(n) or "constexpr" for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _ALIGNED}
    ptx = {}
    for case, (rows, cols, transpose, op, sums, opens) in CASES.items():
        block_m, block_n, warps, _ = default_config(rows, cols, transpose, op, sums)
        constexprs = {
            **_COMMON,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "TRANSPOSE": transpose,
            "SHIFT": opens,
            "COLSUM": sums,
            "SPLIT_ROWS": sums,  # several programs per column tile at these shapes
            "OP": module.OPS[op],
        }
        if stages != "absent":
            constexprs["STAGES"] = None if stages == "none" else int(stages)
        ptx[case] = _sm90_ptx(kernel, signature, constexprs, attrs, warps)
    return ptx


# The norm cast (fp8state._kernels.triton_norm_cast) shares the cast's amax record: its
# launches that open a step, at the forward plans of a 2048-column input (4 warps) and of the
# widest it takes (8 warps).
NORM_CASES = {
    "norm_cast_opening_2048_columns": (2048, 2048),
    "norm_cast_opening_16384_columns": (2048, 16384),
}
_NORM_POINTERS = {
    **{n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr")},
    "out_ptr": "*fp8e4nv",
    **{n: "*fp32" for n in ("mean_ptr", "rstd_ptr", "scale_ptr", "inv_ptr", "inv_out_ptr")},
    "hist_ptr": "*fp32",
    "scratch_ptr": "*i32",
    "eps": "fp32",
}


def compile_norm_ptx(source: Path) -> dict[str, str]:
    """``{case: PTX}`` of ``source``'s norm cast kernel, opening a step, per ``NORM_CASES``."""
    kernel = _kernel_module(source, "triton_norm_cast").norm_cast_kernel
    forward_plan = _kernel_module(source, "norm_launch")._forward_plan
    signature = {
        n: _NORM_POINTERS.get(n) or _SCALARS.get(n) or "constexpr" for n in kernel.arg_names
    }
    ptx = {}
    for case, (rows, cols) in NORM_CASES.items():
        _, _, block_m, block_n, warps = forward_plan(rows, cols, True)
        constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_BIAS": True, "RMS": False}
        constexprs |= {"SHIFT": True, "SLOTS": 4, "CHUNK": 512}
        ptx[case] = _sm90_ptx(kernel, signature, constexprs, {}, warps)
    return ptx


def ptx_digests(source: Path, stages: str) -> dict[str, tuple[str, int]]:
    """``{case: (PTX hash, async copy groups committed)}`` of ``source``'s cast kernel."""
    return {
        case: (hashlib.sha1(ptx.encode()).hexdigest()[:16], ptx.count("cp.async.commit"))
        for case, ptx in compile_ptx(source, stages).items()
    }


def _definition(lines: list[str], register: str, before: int) -> tuple[int, str] | None:
    """The last line before ``before`` that writes ``register`` (its first operand)."""
    for i in range(before - 1, -1, -1):
        parts = lines[i].replace(",", " ").split()
        if len(parts) > 1 and not parts[0].startswith("@") and parts[1] == register:
            return i, lines[i]
    return None


def _derivation(lines: list[str], register: str, before: int, depth: int = 5) -> list[str]:
    """How ``register`` was computed: its definition and, recursively, its operands'."""
    found = _definition(lines, register, before)
    if found is None or depth == 0:
        return []
    i, line = found
    tokens = line.replace(",", " ").replace(";", " ").split()[2:]
    operands = [t for t in tokens if t[:2] in ("%p", "%r")]
    derived = [d for op in operands for d in _derivation(lines, op, i, depth - 1)]
    return [*derived, f"    {line}"]


def memory_order(ptx: str) -> list[str]:
    """The atomics, barriers and loads past L1, in order; each atomic after how its
    predicate (which threads run it) was computed from ``%tid.x``."""
    lines = [line.strip() for line in ptx.splitlines()]
    shown = []
    for i, line in enumerate(lines):
        if line.startswith("@") and " atom." in line:
            shown += _derivation(lines, line.split()[0][1:], i)
        if " atom." in line or line.startswith(("bar.sync", "fence", "membar")) or ".cg." in line:
            shown.append(line)
    return shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--stages", default="none", choices=["none", "3", "absent"])
    parser.add_argument("--order", action="store_true", help="atomics and barriers in order")
    args = parser.parse_args()
    if args.order:
        cases = {**compile_ptx(args.source, args.stages), **compile_norm_ptx(args.source)}
        for case, ptx in cases.items():
            print(f"== {case}", *memory_order(ptx), sep="\n")
        return
    print(json.dumps(ptx_digests(args.source, args.stages), indent=1))


if __name__ == "__main__":
    main()
