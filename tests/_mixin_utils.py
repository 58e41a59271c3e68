"""Helpers of the FP8StateMixin tests (``test_mixin_*.py``): a bare mixin module, a save/load."""

from __future__ import annotations

import io
from typing import Any

import torch

import fp8state


class Bare(fp8state.FP8StateMixin):
    """A mixin module with no parameters or buffers of its own."""

    def __init__(self, num_gemms: int = 1, **kwargs: Any) -> None:
        super().__init__()
        self.init_fp8_meta(num_gemms=num_gemms, **kwargs)


def save_load(obj: Any) -> Any:
    """torch.save then torch.load(weights_only=True), no safe globals added."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)
