"""Launch a compiled Triton kernel again without Triton's per-call argument binding.

``kernel[grid](*args)`` binds and specializes every argument, hashes a cache key and builds
launch metadata on each call: about 20 us of host time per launch on the H200 machine's CPU
(benchmarks/host_overhead.py), several times the launch itself, in a step that launches a
few kernels per GEMM. :class:`FastLauncher` lets Triton compile (and launch) the first call
for each *specialization key* the caller computes, keeps the compiled kernel, and launches it
directly afterwards.

The caller's key must determine everything Triton specializes on: the dtypes and 16-byte
alignment of the pointer arguments, the constexpr values, ``num_warps``, and for integer
arguments not listed in ``do_not_specialize`` whether they equal 1, are multiples of 16 and
fit in 32 bits (:func:`int_spec`). The direct path is used only on the current CUDA device
(a compiled kernel is loaded per device), only on the Triton versions whose launcher this was
checked against (3.6), and only while no launch or pre-run hooks are installed; otherwise
every call goes through ``kernel[grid]``, which is always correct. Debug and instrumentation
settings are those of the first compile for a key.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from typing import Any

import torch

__all__ = ["FastLauncher", "int_spec", "ptr_aligned", "raw_stream"]


def int_spec(value: int) -> tuple[bool, bool, bool]:
    """What Triton specializes an integer argument on: ``== 1``, ``% 16 == 0``, 32-bit."""
    return value == 1, value % 16 == 0, -(2**31) <= value < 2**31


def ptr_aligned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s address is 16-byte aligned (Triton specializes pointers on it)."""
    return tensor.data_ptr() % 16 == 0


def _hook_active(hook: Any) -> bool:
    # Triton 3.5+ keeps hooks in a chain object that is never None; empty means none.
    return hook is not None and getattr(hook, "calls", True) != []


def _hooks_set() -> bool:
    """Whether launch hooks are installed (profilers do so): they need Triton's own path."""
    runtime = _RUNTIME[0]
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def raw_stream(index: int) -> int:
    """The current stream of device ``index`` as the integer handle the launcher takes."""
    return torch._C._cuda_getCurrentRawStream(index)  # what Triton itself calls


_RUNTIME: list[Any] = []  # triton.knobs.runtime, once imported
# Triton versions whose CompiledKernel.run takes (grid x3, stream, function, packed metadata,
# launch metadata, enter hook, exit hook, *args), checked against their sources and run on an
# H200; any other version launches through kernel[grid].
_DIRECT_VERSIONS = {(3, 6)}


def _version(text: str) -> tuple[int, ...]:
    """``"3.6.1+git1234"`` -> ``(3, 6, 1)``: the leading digits of the first three fields."""
    parts = []
    for piece in text.split(".")[:3]:
        match = re.match(r"\d+", piece)
        parts.append(int(match.group()) if match else 0)
    return tuple(parts)


class FastLauncher:
    """Launches ``kernel`` (a ``triton.jit`` function), compiling once per key and device."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple[int, Hashable], Any] = {}
        self._direct = True

    def __call__(
        self,
        key: Hashable,
        grid: Sequence[int],
        args: Sequence[Any],
        device: torch.device,
        num_warps: int = 4,
    ) -> None:
        """Launch on ``grid`` with ``args`` (all parameters in order, constexprs included).

        Args:
            key: Everything Triton specializes on for these arguments (see module docstring).
            grid: Up to three grid dimensions.
            args: Every kernel parameter, positionally, constexpr values included.
            device: The CUDA device of the tensors.
            num_warps: Warps per program (part of the compiled kernel, so of the key too).
        """
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index != torch.cuda.current_device():
            # Another GPU than the current one (a model split over GPUs): Triton launches on
            # the current device, so switch for the launch; rare enough for the slow path.
            with torch.cuda.device(index):
                self.kernel[tuple(grid)](*args, num_warps=num_warps)
            return
        compiled = self._compiled.get((index, key)) if self._direct else None
        if compiled is None or _hooks_set():
            compiled = self.kernel[tuple(grid)](*args, num_warps=num_warps)
            if self._direct:
                self._remember(index, key, compiled)
            return
        g = (*grid, 1, 1)
        compiled.run(
            g[0],
            g[1],
            g[2],
            raw_stream(index),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
        )

    def _remember(self, index: int, key: Hashable, compiled: Any) -> None:
        # Only a compiled kernel with the interface this module launches through is kept;
        # anything else (another Triton version) turns the direct path off for good.
        if not _RUNTIME:
            try:
                import triton
                from triton import knobs
            except ImportError:  # a Triton without knobs: launch through kernel[grid] only
                self._direct = False
                return
            if _version(triton.__version__)[:2] not in _DIRECT_VERSIONS:
                self._direct = False  # the launcher's argument layout is version-specific
                return
            _RUNTIME.append(knobs.runtime)
        if getattr(self.kernel, "pre_run_hooks", None):
            self._direct = False  # hooks that Triton runs before each launch: keep its path
        elif all(hasattr(compiled, n) for n in ("run", "function", "packed_metadata")):
            self._compiled[(index, key)] = compiled
        else:
            self._direct = False
