"""Small FP8StateMixin modules and models, steps that fill their metadata, a save/load.

``TwoGemm`` owns FP8 metadata for two GEMMs (6 forward, 4 backward slots) without quantizing;
``Bare`` is a mixin module with nothing of its own; ``Gated`` takes a keyword tensor;
``run_steps`` gives every mixin module of a model a non-trivial history.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

import fp8state
from fp8state.recipe import DelayedScaling
from fp8state.slots import FwdSlot, fwd_slot

#: The six metadata buffers of every mixin module.
FP8_BUFFERS = tuple(
    f"fp8_{d}_{f}" for d in ("fwd", "bwd") for f in ("amax_history", "scale", "scale_inv")
)


class Gated(nn.Module):
    """An FP8 ``Linear`` whose output a keyword tensor, ``gate``, scales."""

    def __init__(self, hidden: int, **kwargs: Any) -> None:
        super().__init__()
        self.linear = fp8state.Linear(hidden, hidden, **kwargs)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * gate


class TwoGemm(fp8state.FP8StateMixin):
    """``y = (x @ w1.T) @ w2.T`` in high precision; the forward records the 6 forward amaxes.

    Enough of a module to own FP8 metadata for two GEMMs (6 forward, 4 backward slots) and
    exercise checkpoints; it does not quantize.
    """

    def __init__(
        self,
        hidden: int = 4,
        *,
        history_rows: int = 16,
        recipe: DelayedScaling | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(hidden, hidden, device=device))
        self.w2 = nn.Parameter(torch.randn(hidden, hidden, device=device))
        self.register_buffer("step_count", torch.zeros((), dtype=torch.int64, device=device))
        self.init_fp8_meta(num_gemms=2, history_rows=history_rows, recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1.T
        y = h @ self.w2.T
        for gemm, (inp, w, out) in enumerate(((x, self.w1, h), (h, self.w2, y))):
            self.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.INPUT), inp.abs().amax())
            self.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.WEIGHT), w.abs().amax())
            self.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.OUTPUT), out.abs().amax())
        return y


class Bare(fp8state.FP8StateMixin):
    """A mixin module with no parameters or buffers of its own."""

    def __init__(self, num_gemms: int = 1, **kwargs: Any) -> None:
        super().__init__()
        self.init_fp8_meta(num_gemms=num_gemms, **kwargs)


def make_model(n_blocks: int = 2, **kwargs: Any) -> nn.Module:
    """A model of several mixin modules under prefixes ``blocks.{i}`` plus one plain Linear."""
    model = nn.Module()
    model.blocks = nn.ModuleList(TwoGemm(**kwargs) for _ in range(n_blocks))
    model.head = nn.Linear(kwargs.get("hidden", 4), 2, device=kwargs.get("device"))
    return model


def mixin_modules(model: nn.Module) -> dict[str, fp8state.FP8StateMixin]:
    """Every FP8StateMixin in ``model`` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, fp8state.FP8StateMixin)}


def run_steps(model: nn.Module, steps: int, *, seed: int = 0) -> None:
    """Give every mixin module of ``model`` a non-trivial history: ``steps`` steps of random
    amaxes in every slot of both directions, each step ending with a scale update.

    Amaxes span many binades (2**-20 .. 2**20), so scales exercise the full float32 mantissa.
    """
    gen = torch.Generator().manual_seed(seed)
    for module in mixin_modules(model).values():
        device = module.fp8_meta("fwd").scale.device
        for _ in range(steps):
            for direction in ("fwd", "bwd"):
                n = module.fp8_meta(direction).scale.numel()
                amax = torch.exp2(torch.rand(n, generator=gen) * 40 - 20).to(device)
                for slot in range(n):
                    module.fp8_record_amax(direction, slot, amax[slot])
                module.fp8_update_scales(direction)


def save_load(obj: Any, map_location: Any = None) -> Any:
    """torch.save then torch.load(weights_only=True), in memory, no safe globals added."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, map_location=map_location)
