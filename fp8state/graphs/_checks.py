"""What ``make_graphed_callables`` checks: at capture, and before every replay.

A CUDA graph replays the kernels it recorded on the memory it recorded: the same input
shapes, the same parameter and FP8 buffer tensors, the FP8 settings it was captured under.
Each check here turns a change that would replay stale work into a ``ConfigError`` naming
what changed; none of them costs a device synchronization.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from fp8state import autocast
from fp8state._runtime.generation import buffer_generation
from fp8state.errors import ConfigError
from fp8state.mixin import FP8StateMixin
from fp8state.slots import DIRECTIONS

__all__ = ["ArgSpec", "check_callables", "check_args", "FP8Buffers", "check_context"]

_WHERE = "make_graphed_callables"


def check_callables(callables: Sequence[object], sample_args: Sequence[object]) -> None:
    """Modules only (their parameters and FP8 modules must be found), tensors only, on CUDA.

    The checks of the arguments' kinds come first, so they hold on machines without CUDA too.
    """
    if len(callables) != len(sample_args):
        raise ConfigError(
            f"{_WHERE}(sample_args=...)",
            f"{len(sample_args)} argument tuples for {len(callables)} callables",
            "one tuple of sample arguments per callable",
            "Pass sample_args as a tuple of tuples, in the order of the callables.",
        )
    for i, (module, args) in enumerate(zip(callables, sample_args, strict=True)):
        where = f"{_WHERE}: callable {i}"
        if not isinstance(module, nn.Module):
            raise ConfigError(
                where,
                type(module).__name__,
                "a torch.nn.Module (its parameters and FP8 modules are found through it)",
                "Wrap the function in an nn.Module that holds the modules it calls.",
            )
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            raise ConfigError(
                where,
                "hooks registered on the module",
                "no hooks at capture (a replay would not run them)",
                "Register hooks after make_graphed_callables, or on submodules.",
            )
        if not isinstance(args, tuple) or not all(isinstance(a, torch.Tensor) for a in args):
            raise ConfigError(
                f"{where}, sample_args",
                repr(type(args).__name__),
                "a tuple of tensors",
                "Pass the forward's positional tensor arguments as a tuple.",
            )
    if not torch.cuda.is_available():
        raise ConfigError(
            _WHERE,
            "no CUDA device",
            "a CUDA device: a graph records CUDA kernels",
            "Run the callables eagerly on this machine (they compute the same).",
        )
    for i, args in enumerate(sample_args):
        for j, arg in enumerate(cast(tuple[torch.Tensor, ...], args)):
            if arg.device.type != "cuda":
                raise ConfigError(
                    f"{_WHERE}: callable {i}, sample_args[{j}]",
                    f"a tensor on {arg.device}",
                    "a tensor on the CUDA device the module runs on",
                    "Move the sample arguments to the module's device.",
                )


@dataclass(frozen=True)
class ArgSpec:
    """What a replay's arguments must match: those the graph was captured with."""

    shapes: tuple[tuple[torch.Size, torch.dtype, torch.device, bool], ...]

    @classmethod
    def of(cls, args: Sequence[torch.Tensor]) -> ArgSpec:
        """The spec of ``args``."""
        return cls(tuple((a.shape, a.dtype, a.device, a.requires_grad) for a in args))


def check_args(spec: ArgSpec, args: Sequence[object], index: int) -> None:
    """Raise unless ``args`` match ``spec``: count, shape, dtype, device, requires_grad."""
    if len(args) != len(spec.shapes):
        raise ConfigError(
            f"graphed callable {index}",
            f"{len(args)} arguments",
            f"{len(spec.shapes)} tensors, as in its sample_args",
            "Call it with the arguments it was captured with (positional tensors).",
        )
    for j, (arg, want) in enumerate(zip(args, spec.shapes, strict=True)):
        if not isinstance(arg, torch.Tensor):
            got = type(arg).__name__
        else:
            got_spec = (arg.shape, arg.dtype, arg.device, arg.requires_grad)
            if got_spec == want:
                continue
            got = _describe(got_spec)
        raise ConfigError(
            f"graphed callable {index}, argument {j}",
            got,
            f"{_describe(want)} (the graph's; a replay cannot change shapes)",
            "Capture a graph per shape (one make_graphed_callables call each), or pad.",
        )


def _describe(spec: tuple[torch.Size, torch.dtype, torch.device, bool]) -> str:
    shape, dtype, device, grad = spec
    return f"shape {tuple(shape)}, {dtype}, {device}, requires_grad={grad}"


class FP8Buffers:
    """The parameter and FP8 buffer tensors a graph recorded, checked before each replay."""

    def __init__(self, module: nn.Module, fp8_modules: Sequence[FP8StateMixin]) -> None:
        self.module = module
        self.params = tuple(module.parameters())
        self.pointers = self._pointers()
        self.fp8_modules = tuple(fp8_modules)
        self.buffers = self._buffers()
        self.generation = buffer_generation()

    def _pointers(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.params)

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for m in self.fp8_modules for d in DIRECTIONS for t in m.fp8_meta(d))

    def check(self, index: int) -> None:
        """Raise if a parameter or FP8 buffer is another tensor than at capture."""
        if self._pointers() != self.pointers or not _same(self.module.parameters(), self.params):
            raise ConfigError(
                f"graphed callable {index}",
                "parameters replaced or moved since capture (.to(), a new Parameter)",
                "the parameter tensors the graph recorded",
                "Update parameters in place (optimizers do), or graph the module again.",
            )
        generation = buffer_generation()
        if generation == self.generation:  # nothing replaced anywhere: the common case
            return
        if not _same(self._buffers(), self.buffers):
            raise ConfigError(
                f"graphed callable {index}",
                "FP8 buffers replaced since capture (.to(), a longer history loaded)",
                "the FP8 metadata tensors the graph recorded",
                "Load checkpoints with the module's own history length, or graph again.",
            )
        self.generation = generation


def _same(now: Iterable[torch.Tensor], then: tuple[torch.Tensor, ...]) -> bool:
    """The same tensor objects, in the same order (identity: ``==`` would compare values)."""
    current = tuple(now)
    return len(current) == len(then) and all(a is b for a, b in zip(current, then, strict=True))


def check_context(captured: autocast.FP8Context, index: int) -> None:
    """Raise if an enclosing ``fp8_autocast`` asks for other FP8 settings than the graph's."""
    outer = autocast.innermost_context()
    if outer is None or outer == captured:
        return
    raise ConfigError(
        f"graphed callable {index}",
        f"called inside fp8_autocast({_settings(outer)})",
        f"no fp8_autocast, or the graph's own: {_settings(captured)}",
        "Graph the module again with the FP8 settings you want (fp8_enabled, fp8_recipe...).",
    )


def _settings(ctx: autocast.FP8Context) -> str:
    return (
        f"enabled={ctx.enabled}, calibrating={ctx.calibrating}, recipe={ctx.recipe}, "
        f"gemm_backend={ctx.gemm_backend!r}"
    )
