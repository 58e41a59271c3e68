"""How :func:`fp8state.recalibrate` passes a batch to the model, and the error when it can't.

A tensor goes in as ``model(x)``, a tuple or list as ``model(*batch)``, a dict as
``model(**batch)``; ``forward_fn`` replaces all of that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fp8state.errors import ConfigError

__all__ = ["forward_batch"]

_WHERE = "recalibrate(batches=...)"
_KEYS_SHOWN = 5


def _unpacked(batch: Any) -> str:
    """How an unpacked batch reached the model, e.g. ``a list of 2 items as model(*batch)``."""
    if isinstance(batch, Mapping):
        keys = [repr(k) for k in list(batch)[:_KEYS_SHOWN]]
        more = ", ..." if len(batch) > _KEYS_SHOWN else ""
        return f"a dict with keys [{', '.join(keys)}{more}] as model(**batch)"
    return f"a {type(batch).__name__} of {len(batch)} items as model(*batch)"


def _signature_error(module: nn.Module, batch: Any, err: TypeError) -> ConfigError:
    first = "batch['input']" if isinstance(batch, Mapping) else "batch[0]"
    return ConfigError(
        _WHERE,
        f"TypeError from {type(module).__name__}.forward ({err}) when passed {_unpacked(batch)}",
        "batches whose items are the model's forward arguments, or a forward_fn",
        f"If a batch also holds targets (a DataLoader of (input, target) pairs), pass "
        f"forward_fn=lambda model, batch: model({first}) (or whatever calls the model on the "
        "batch); nothing was changed.",
    )


def forward_batch(
    module: nn.Module, batch: Any, forward_fn: Callable[[nn.Module, Any], Any] | None
) -> Any:
    """Run ``module`` on ``batch``: through ``forward_fn``, or unpacking the batch.

    Returns:
        The model's output.

    Raises:
        ConfigError: a batch that is not a tensor, tuple, list or dict and no ``forward_fn``;
            or a tuple, list or dict batch the model raised ``TypeError`` for (typically an
            ``(input, target)`` pair passed as ``model(input, target)``), chained to it.
    """
    if forward_fn is not None:
        return forward_fn(module, batch)
    if isinstance(batch, torch.Tensor):
        return module(batch)  # a TypeError here is the model's own: left as it is
    if isinstance(batch, (Mapping, tuple, list)):
        try:
            return module(**batch) if isinstance(batch, Mapping) else module(*batch)
        except TypeError as err:
            raise _signature_error(module, batch, err) from err
    raise ConfigError(
        _WHERE,
        f"a batch of type {type(batch).__name__}",
        "a tensor, a tuple/list of positional arguments or a dict of keyword arguments",
        "Pass forward_fn=lambda model, batch: model(...) to say how a batch reaches the model.",
    )
