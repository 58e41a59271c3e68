"""What ``make_graphed_callables`` checks: at capture, and before every replay.

A CUDA graph replays the kernels it recorded on the memory it recorded: the same input
shapes, the same parameter and FP8 buffer tensors, the FP8 settings it was captured under.
Each check here turns a change that would replay stale work into a ``ConfigError`` naming
what changed; none of them costs a device synchronization.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from fp8state import autocast
from fp8state._runtime.generation import buffer_generation
from fp8state.errors import ConfigError
from fp8state.mixin import FP8StateMixin
from fp8state.slots import DIRECTIONS

__all__ = [
    "ArgSpec",
    "check_callables",
    "check_args",
    "FP8Buffers",
    "check_context",
    "microbatch_flag",
    "weights_cached",
]

_WHERE = "make_graphed_callables"


def check_callables(
    callables: Sequence[object],
    sample_args: Sequence[object],
    sample_kwargs: Sequence[object] | None = None,
) -> None:
    """Modules only (their parameters and FP8 modules must be found), tensors only, on CUDA.

    ``sample_kwargs``: one dict of keyword tensors per callable (None: none at all). The
    checks of the arguments' kinds come first, so they hold on machines without CUDA too.
    """
    kwargs_per = [{}] * len(callables) if sample_kwargs is None else sample_kwargs
    for name, given in (("sample_args", sample_args), ("sample_kwargs", kwargs_per)):
        if len(callables) != len(given):
            raise ConfigError(
                f"{_WHERE}({name}=...)",
                f"{len(given)} argument {'tuples' if name == 'sample_args' else 'dicts'} for "
                f"{len(callables)} callables",
                "one per callable",
                f"Pass {name} as a tuple with one entry per callable, in their order.",
            )
    for i, (module, args, kwargs) in enumerate(
        zip(callables, sample_args, kwargs_per, strict=True)
    ):
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
        if not isinstance(kwargs, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in kwargs.items()
        ):
            raise ConfigError(
                f"{where}, sample_kwargs",
                _kinds(kwargs),
                "a dict of keyword names to tensors",
                "Pass the forward's keyword tensor arguments as a dict (non-tensor settings: "
                "fix them in the module before capture).",
            )
    if not torch.cuda.is_available():
        raise ConfigError(
            _WHERE,
            "no CUDA device",
            "a CUDA device: a graph records CUDA kernels",
            "Run the callables eagerly on this machine (they compute the same).",
        )
    for i, (args, kwargs) in enumerate(zip(sample_args, kwargs_per, strict=True)):
        named = {f"sample_args[{j}]": a for j, a in enumerate(cast(tuple[torch.Tensor, ...], args))}
        for key, value in cast(dict[str, torch.Tensor], kwargs).items():
            named[f"sample_kwargs[{key!r}]"] = value
        for name, arg in named.items():
            if arg.device.type != "cuda":
                raise ConfigError(
                    f"{_WHERE}: callable {i}, {name}",
                    f"a tensor on {arg.device}",
                    "a tensor on the CUDA device the module runs on",
                    "Move the sample arguments to the module's device.",
                )


def _kinds(kwargs: object) -> str:
    """``{'gate': Tensor, ...}`` for a dict, the type's name otherwise (no values printed)."""
    if not isinstance(kwargs, dict):
        return type(kwargs).__name__
    return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in kwargs.items()) + "}"


@dataclass(frozen=True)
class ArgSpec:
    """What a replay's arguments must match: those the graph was captured with."""

    shapes: tuple[tuple[torch.Size, torch.dtype, torch.device, bool], ...]

    @classmethod
    def of(cls, args: Sequence[torch.Tensor]) -> ArgSpec:
        """The spec of ``args``."""
        return cls(tuple((a.shape, a.dtype, a.device, a.requires_grad) for a in args))


def check_args(
    spec: ArgSpec, args: Sequence[object], index: int, names: Sequence[str] = ()
) -> None:
    """Raise unless ``args`` match ``spec``: count, shape, dtype, device, requires_grad.

    The last ``len(names)`` of ``args`` were passed by keyword, with these ``names``.
    """
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
        positional = len(args) - len(names)
        which = f"argument {j}" if j < positional else f"argument {names[j - positional]!r}"
        raise ConfigError(
            f"graphed callable {index}, {which}",
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


_FLAG = "is_first_microbatch"


def microbatch_flag(kwargs: dict[str, Any], caching: bool, index: int) -> bool | None:
    """Take ``is_first_microbatch`` out of a call's ``kwargs``: a bool with caching, else None.

    Raises:
        ConfigError: missing or not a bool where the graphs cache FP8 weights; True or False
            where they do not (they cast the weights every call and have nothing to reuse).
    """
    given = _FLAG in kwargs
    flag = kwargs.pop(_FLAG, None)
    if not caching:
        if flag is not None:
            raise ConfigError(
                f"graphed callable {index}, {_FLAG}",
                f"{flag!r}, on graphs captured without FP8 weight caching",
                "no is_first_microbatch, or None (these graphs cast the weights every call)",
                "Drop the argument, or graph with make_graphed_callables(..., "
                "fp8_weight_caching=True).",
            )
        return None
    if not isinstance(flag, bool):
        raise ConfigError(
            f"graphed callable {index}, {_FLAG}",
            repr(flag) if given else "missing",
            "True or False: the graphs were captured with fp8_weight_caching=True",
            "Pass is_first_microbatch=True on the first micro-batch after each optimizer step "
            "(it casts the weights) and False on the others (they reuse the FP8 copies).",
        )
    return flag


def weights_cached(weights: Sequence[tuple[FP8StateMixin, dict[int, Any]]], index: int) -> bool:
    """Whether the FP8 modules hold the graphs' cached weights (True) or none at all (False).

    ``weights``: per module, the cache entries the first micro-batch's graph writes. None
    held (a fresh capture, or a load that emptied the caches) means a later micro-batch must
    cast as a first one does, which is what an eager call would do.

    Raises:
        ConfigError: some modules hold the graphs' copies and others none, or a module holds
            copies an eager call made: the graphs can reuse neither, and casting afresh would
            not compute what the eager call reusing them computes.
    """
    states = {
        "graph"
        if module.fp8_weight_cache.get(gemm) is entry
        else ("none" if gemm not in module.fp8_weight_cache else "eager")
        for module, entries in weights
        for gemm, entry in entries.items()
    }
    if states <= {"graph"}:
        return True
    if states == {"none"}:
        return False
    raise ConfigError(
        f"graphed callable {index}, is_first_microbatch=False",
        "FP8 weight caches the graphs cannot reuse (copies cast by an eager call, or "
        "emptied for some modules only)",
        "the FP8 weights the graph's first micro-batch cached, or none in any module",
        "Pass is_first_microbatch=True to cast the weights again inside the graph.",
    )
