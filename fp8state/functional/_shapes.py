"""Tokens in, tokens out: the 2-D views FP8 GEMMs take, for the eager and the compiled path."""

from __future__ import annotations

import torch

__all__ = ["as_2d", "like_input"]


def as_2d(inp: torch.Tensor) -> torch.Tensor:
    """``(..., k)`` as ``(tokens, k)``, a view where the layout allows (never a copy of 2-D).

    A 2-D input is returned as it is: even a no-op view costs host time on the hot path.
    """
    return inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])


def like_input(out_2d: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """A ``(tokens, n)`` result shaped ``(..., n)`` like ``inp``'s leading dimensions."""
    return out_2d if inp.dim() == 2 else out_2d.view(*inp.shape[:-1], out_2d.shape[-1])
