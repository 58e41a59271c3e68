"""CUDA graphs of FP8 modules: whole FP8 steps replayed with no host work per kernel.

:func:`make_graphed_callables` is TransformerEngine's function of the same name for fp8state
modules, on PyTorch's own CUDA graphs: each module's forward and backward are captured with
their FP8 casts, amax records and scale updates inside, and replayed from then on.
``docs/graphs.md`` is the guide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fp8state.autocast import FP8Context, fp8_autocast, innermost_context
from fp8state.errors import ConfigError
from fp8state.graphs._capture import capture_all, fp8_modules_of, positional
from fp8state.graphs._checks import check_callables
from fp8state.graphs._graphed import GraphedForward
from fp8state.recipe import DelayedScaling

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["make_graphed_callables"]


def make_graphed_callables(
    modules: nn.Module | tuple[nn.Module, ...],
    sample_args: tuple[torch.Tensor, ...] | tuple[tuple[torch.Tensor, ...], ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    *,
    fp8_enabled: bool = True,
    fp8_calibrating: bool = False,
    fp8_recipe: DelayedScaling | None = None,
    fp8_group: ProcessGroup | None = None,
    gemm_backend: str = "auto",
    pool: Any = None,
    sample_kwargs: dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], ...] | None = None,
    fp8_weight_caching: bool = False,
) -> nn.Module | tuple[nn.Module, ...]:
    """Capture each module's forward and backward, FP8 step included, in CUDA graphs.

    Each module then runs its graphs in the training mode it was captured in (with gradients
    enabled): its forward replays the forward graph (the FP8 casts, amax records and, at its
    end, the forward scale update over ``fp8_group``) and adds one autograd node whose backward
    replays the backward graph (ending with the backward scale update). In the other mode it
    runs its own forward eagerly, under the same FP8 settings unless an ``fp8_autocast``
    encloses the call. Several modules share one memory pool and must then run in the order
    given, as with ``torch.cuda.make_graphed_callables``.

    Replays compute what the eager steps compute, bit for bit, and leave the FP8 metadata as
    they do; ``state_dict()`` and ``load_state_dict`` work between replays (a load copies into
    the tensors the graphs read). The warm-up steps capture needs do not count: the FP8
    metadata is put back as it was before them.

    Args:
        modules: A module, or a tuple of modules, called with tensors (positional, and
            keyword ones where ``sample_kwargs`` has them).
        sample_args: The forward's arguments (a tuple of tensors), or one such tuple per
            module. Their shapes, dtypes and ``requires_grad`` are the graph's for good.
        num_warmup_iters: Eager steps before capture (kernels compiled, workspaces made).
        allow_unused_input: As in ``torch.autograd.grad``.
        fp8_enabled: As ``fp8_autocast(enabled=...)``: compute in FP8 inside the graphs.
        fp8_calibrating: As ``fp8_autocast(calibrating=...)``.
        fp8_recipe: As ``fp8_autocast(fp8_recipe=...)``.
        fp8_group: As ``fp8_autocast(fp8_group=...)``: the amax all-reduce is captured too.
        gemm_backend: As ``fp8_autocast(gemm_backend=...)``.
        pool: A memory pool handle (``torch.cuda.graph_pool_handle()``) to share with other
            graphs; a new pool by default.
        sample_kwargs: The forward's keyword tensor arguments (a dict), or one such dict per
            module; each call then passes the same names, with tensors as the sample's.
        fp8_weight_caching: As TransformerEngine's: cast the FP8 weights once per optimizer
            step. Every call in the captured mode then passes ``is_first_microbatch``: True
            on the first micro-batch after an optimizer step (its graphs cast the weights
            and keep the FP8 copies), False on the others (their graphs reuse the copies and
            cast no weight), exactly as the FP8 modules' own ``is_first_microbatch`` does
            eagerly, whether or not the callable passes it down to them. This captures a
            second set of graphs, in a memory pool of its own. The modules' FP8 weight
            caches start empty: a False call that finds none casts, as an eager one does.

    Returns:
        The modules themselves (a tuple if a tuple was given), their forwards replaced.

    Raises:
        ConfigError: no CUDA device; a callable that is not an ``nn.Module`` or has hooks;
            sample arguments that are not CUDA tensors; FP8 settings ``fp8_autocast``
            refuses; called inside an ``fp8_autocast`` (its exit would update the scales
            outside the graph); with ``fp8_weight_caching``, a compiled FP8 module in a
            callable. Later, at a call in the captured mode: arguments of another
            shape, dtype, device or ``requires_grad``, keyword names other than those of
            ``sample_kwargs``, parameters or FP8 buffers replaced by other tensors, an
            enclosing ``fp8_autocast`` with other settings than the graph's, or an
            ``is_first_microbatch`` that the graphs cannot follow (missing with weight
            caching, given without it, False where an eager call cached the weights).

    Example:
        >>> import torch, fp8state
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> layer = fp8state.Linear(256, 256, params_dtype=torch.bfloat16, device=device)
        >>> x = torch.randn(128, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
        >>> try:
        ...     layer = fp8state.make_graphed_callables(layer, (x,))
        ... except fp8state.errors.ConfigError as err:  # graphs record CUDA kernels
        ...     assert device == "cpu" and "no CUDA device" in str(err)
        >>> layer(x).float().sum().backward()  # on a GPU, one replayed FP8 step
    """
    just_one = not isinstance(modules, tuple)
    callables: tuple[Any, ...] = (modules,) if just_one else modules  # type: ignore[assignment]
    per_module = (sample_args,) if just_one else sample_args
    kwargs_per: Any = sample_kwargs  # one dict per module, checked below
    if sample_kwargs is None:
        kwargs_per = ({},) * len(callables)
    elif just_one:
        kwargs_per = (sample_kwargs,)
    fp8_autocast(
        enabled=fp8_enabled,
        calibrating=fp8_calibrating,
        fp8_recipe=fp8_recipe,
        fp8_group=fp8_group,
        gemm_backend=gemm_backend,
    )  # checks the settings, enters nothing
    check_callables(callables, per_module, kwargs_per)
    if innermost_context() is not None:
        raise ConfigError(
            "make_graphed_callables",
            "called inside fp8_autocast",
            "a call outside any fp8_autocast (the graphs hold their own)",
            "Call make_graphed_callables before entering fp8_autocast.",
        )
    ctx = FP8Context(
        enabled=bool(fp8_enabled),
        calibrating=bool(fp8_calibrating),
        recipe=fp8_recipe or DelayedScaling(),
        group=fp8_group,
        gemm_backend=gemm_backend,
    )
    originals = [m.forward for m in callables]
    names = [tuple(kwargs) for kwargs in kwargs_per]
    captured, tables = capture_all(
        [positional(f, len(a), n) for f, a, n in zip(originals, per_module, names, strict=True)],
        callables,
        [(*a, *k.values()) for a, k in zip(per_module, kwargs_per, strict=True)],
        ctx,
        num_warmup_iters,
        allow_unused_input,
        pool if pool is not None else torch.cuda.graph_pool_handle(),
        bool(fp8_weight_caching),
    )
    for i, (module, original, graphs) in enumerate(
        zip(callables, originals, captured, strict=True)
    ):
        fp8 = fp8_modules_of(module)
        module.forward = GraphedForward(i, module, original, graphs, ctx, fp8, tables, names[i])
    return callables[0] if just_one else callables
