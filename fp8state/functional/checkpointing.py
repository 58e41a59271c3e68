"""``activation_checkpoint``: ``torch.utils.checkpoint.checkpoint`` that replays FP8 exactly.

``torch.utils.checkpoint`` itself works with fp8state's modules: each recomputed FP8 call
replays its forward (``docs/activation_checkpointing.md``). Where a recomputation cannot be
told apart from other pending forwards of the same module with other scales (several
micro-batches or pipeline stages in flight before one backward, backwards out of forward
order, a segment recomputed twice), that raises
:class:`~fp8state.errors.RecomputationError`. This drop-in gives each checkpoint a scope of
its own (TE ships ``te.distributed.checkpoint`` for the same reason): exact in every case.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint

from fp8state._runtime import replay_scope

__all__ = ["activation_checkpoint"]


def activation_checkpoint(
    function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any
) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, ...)`` with exact FP8 replays.

    The first run of ``function`` (the forward) keeps what every FP8 GEMM call in it did: the
    ``fp8_autocast`` context, FP8 or not, the scales, the cached weights; each recomputation
    replays the same calls from that record, in order, recording no amax and updating no
    scale. Losses, gradients and FP8 metadata are bit-identical to the same steps without
    checkpointing, whatever runs between the forward and its backward, with
    ``fp8_autocast`` outside or inside ``function``.

    Args:
        function: The checkpointed function (a module, or a function of several).
        *args: Its positional arguments, as for ``torch.utils.checkpoint.checkpoint``.
        use_reentrant: PyTorch's two implementations; unlike PyTorch's, the default is
            False (PyTorch's recommended one) instead of a warning.
        **kwargs: Passed to ``torch.utils.checkpoint.checkpoint`` (``preserve_rng_state``,
            ``context_fn``, ``determinism_check``, ...) and, as PyTorch does, keyword
            arguments of ``function`` (non-reentrant only).

    Returns:
        What ``function`` returns.

    Raises:
        RecomputationError: a recomputation runs a GEMM call its forward did not (a
            ``function`` whose calls depend on data or on the step).

    Example:
        >>> import torch, fp8state
        >>> from fp8state.functional import activation_checkpoint
        >>> block = fp8state.LayerNormMLP(32, 64)
        >>> block.fp8_min_gemm_macs = 0  # FP8 even at this toy size
        >>> x = torch.randn(16, 32, requires_grad=True)
        >>> with fp8state.fp8_autocast():
        ...     y = activation_checkpoint(block, x)
        >>> y.sum().backward()  # recomputes block in FP8 with the forward's scales
        >>> x.grad.shape, block.fp8_last_gemm_backend
        (torch.Size([16, 32]), 'emulated')
    """
    scope = replay_scope.Scope()

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        with replay_scope.running(scope):
            return function(*inner_args, **inner_kwargs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)
