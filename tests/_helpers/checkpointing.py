"""Activation checkpointing as the tests run it: four modes of recomputing a forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.checkpoint import checkpoint

from fp8state.functional import activation_checkpoint

#: torch.utils.checkpoint and fp8state's drop-in, each with and without reentrancy.
MODES = ("torch-reentrant", "torch", "drop-in-reentrant", "drop-in")


def checkpointed(mode: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` under the checkpoint ``mode`` names (``"none"``: plainly)."""
    if mode == "none":
        return fn(*args)
    reentrant = mode.endswith("reentrant")
    if mode.startswith("torch"):
        return checkpoint(fn, *args, use_reentrant=reentrant)
    return activation_checkpoint(fn, *args, use_reentrant=reentrant)
