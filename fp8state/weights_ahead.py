"""``fp8state.cast_weights_ahead``: a step's FP8 weight casts back to back, before its forwards.

Each FP8 GEMM casts its weight in its own forward, between its layer's other kernels; a
model whose layers are called without ``is_first_microbatch`` casts them again in every
micro-batch. The block casts them once, one after the other, before the first forward, and
every FP8 call inside reuses the copy cast ahead for it, as a later micro-batch reuses a first
one's (what it saves: docs/benchmarks.md). A step computes and records what it computes and
records without the block: the same casts with the same scales, the same amaxes in the same
history rows, bit for bit.

That holds only where each weight cast ahead is then multiplied in FP8 inside the block.
Whether a GEMM runs in FP8 depends on its tokens (``fp8_min_gemm_macs``), which the block
must be told; a weight cast ahead that no FP8 call took (a call of other tokens fell back, or
the module was not called) has a record its step would not have, and the block raises at its
end instead of letting that step's scales pass for the usual ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from fp8state import autocast
from fp8state._runtime import microbatch
from fp8state._runtime.amax_reduction import open_steps
from fp8state.errors import ConfigError
from fp8state.functional.linear import cast_weight_ahead, runs_in_fp8
from fp8state.mixin import FP8StateMixin

__all__ = ["cast_weights_ahead"]


@contextlib.contextmanager
def cast_weights_ahead(modules: nn.Module | Iterable[nn.Module], tokens: int) -> Iterator[None]:
    """Cast the FP8 weights of ``modules`` now, together; the block's FP8 calls reuse them.

    Enter it inside ``fp8_autocast``, around a step's forwards (all its micro-batches: the
    weights do not change until the optimizer steps). Each weight is cast as a first
    micro-batch's call would cast it (``is_first_microbatch=True``: its slot's scale, its amax
    recorded, the transposed copy too where gradients are enabled), and the calls inside
    reuse it whatever ``is_first_microbatch`` they pass or omit, so a Hugging Face model's
    layers need no argument; other modules' calls run as they would without the block.
    Backward, and activation checkpointing's recomputation, use what their forward used. The
    copies stay in the modules' ``fp8_weight_cache``, as a first micro-batch's do, until a
    later cast replaces them.

    Outside ``fp8_autocast(enabled=True)`` (FP8 off, calibrating, no context) the block does
    nothing. Not for compiled calls (one under the block raises): a compiled step casts inside
    its graph.

    Args:
        modules: A model, or modules; every FP8 module in them with a ``fp8_gemm_weights``
            method (fp8state's layers; yours, if you define it) is cast.
        tokens: The rows each GEMM of these modules multiplies in the block (``batch * seq``),
            which decide, as in the calls, which GEMMs run in FP8: those below a module's
            ``fp8_min_gemm_macs`` are not cast.

    Raises:
        ConfigError: ``tokens`` is not a positive int, a weight is not a plain tensor (FSDP2
            gathers sharded weights in the module's own forward), the block is nested in
            another, or, at the end of the block, a weight cast ahead was not multiplied in
            FP8 inside it.

    Example:
        >>> import torch, fp8state
        >>> model = torch.nn.Sequential(fp8state.Linear(16, 16), fp8state.Linear(16, 16))
        >>> x = torch.randn(8, 16)
        >>> with fp8state.fp8_autocast():
        ...     with fp8state.cast_weights_ahead(model, tokens=8):
        ...         y = model(x)  # both weights were cast before the first layer ran
        >>> y.sum().backward()
    """
    if torch.compiler.is_compiling():
        raise ConfigError(
            "cast_weights_ahead",
            "the block inside a function being compiled",
            "the block around eager or graphed calls",
            "Enter it outside the compiled function, or drop it: a compiled step casts its "
            "weights inside its graph.",
        )
    ctx = autocast.active_context()
    if ctx is None or not ctx.enabled:
        yield
        return
    # Per module, the GEMMs whose calls of these tokens run in FP8: the only ones cast.
    plan = []
    for name, module, weights in _fp8_weights(modules, tokens):
        gemms = [g for g, w in enumerate(weights) if runs_in_fp8(module, ctx, w, tokens)]
        if gemms:
            plan.append((name, module, weights, gemms))
    # Entered before the casts: a block inside another raises before anything is recorded.
    with microbatch.ahead(microbatch.Ahead()) as block:
        # One opening of every module's step in a few launches, where the first cast of each
        # would open its own (a slower launch each: docs/benchmarks.md); the same bits.
        open_steps("fwd", [module for _, module, _, _ in plan])
        for name, module, weights, gemms in plan:
            autocast.register_forward(module, ctx)  # its step must close, called or not
            for gemm in gemms:
                cast_weight_ahead(module, ctx, gemm, weights[gemm])
                block.add(module, gemm, name)
        yield
    if block.waiting:
        raise ConfigError(
            ", ".join(sorted(set(block.waiting.values()))),
            f"weights cast ahead for {tokens} tokens that no FP8 call inside the block "
            "multiplied with (a call of other tokens fell back to high precision, or the "
            "module was not called); this step's history holds their records all the same",
            "every weight cast ahead multiplied in FP8 inside the block",
            "Pass the tokens the modules' GEMMs see, or leave out the modules called with "
            "others or not at all.",
        )


def _fp8_weights(
    modules: nn.Module | Iterable[nn.Module], tokens: int
) -> list[tuple[str, FP8StateMixin, tuple[torch.Tensor, ...]]]:
    """``(name, module, weights)`` of each FP8 module to cast, checked before any is cast."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ConfigError(
            "cast_weights_ahead(tokens=...)",
            repr(tokens),
            "a positive int: the rows each GEMM multiplies (batch * sequence)",
            "Pass e.g. tokens=x.shape[:-1].numel().",
        )
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    found: dict[int, tuple[str, FP8StateMixin, tuple[torch.Tensor, ...]]] = {}
    for index, root in enumerate(roots):
        prefix = "" if isinstance(modules, nn.Module) else f"[{index}]"
        for name, module in root.named_modules(prefix=prefix):
            gemm_weights = getattr(module, "fp8_gemm_weights", None)
            if not isinstance(module, FP8StateMixin) or gemm_weights is None:
                continue
            name = name or type(module).__name__
            weights = tuple(gemm_weights())
            for gemm, weight in enumerate(weights):
                if type(weight) not in (torch.Tensor, nn.Parameter):
                    raise ConfigError(
                        f"{name} (GEMM {gemm})",
                        f"a weight of type {type(weight).__name__}",
                        "a plain tensor, which the module multiplies as it is",
                        "Cast ahead only modules whose weights are whole on this rank (FSDP2 "
                        "gathers sharded ones in the module's own forward).",
                    )
            found.setdefault(id(module), (name, module, weights))
    return list(found.values())
