"""FP8 metadata materialized from the meta device starts fresh, and fp8_reset_meta resets it."""

from __future__ import annotations

import torch
from torch import nn

import fp8state


def _fresh_metadata(module: fp8state.FP8StateMixin) -> bool:
    return all(
        torch.equal(hist, torch.zeros_like(hist))
        and torch.equal(scale, torch.ones_like(scale))
        and torch.equal(inv, torch.ones_like(inv))
        for hist, scale, inv in (module.fp8_meta(d) for d in ("fwd", "bwd"))
    )


def test_to_empty_from_meta_gives_fresh_metadata_and_trains() -> None:
    with torch.device("meta"):
        model = nn.Sequential(fp8state.Linear(32, 64), nn.GELU(), fp8state.LayerNormMLP(64, 128))
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    assert all(_fresh_metadata(m) for m in model if isinstance(m, fp8state.FP8StateMixin))
    x = torch.randn(8, 32)
    for _ in range(3):
        with fp8state.fp8_autocast():
            loss = model(x).pow(2).mean()
        loss.backward()
    assert torch.isfinite(loss)
    # A checkpoint of it loads back (its metadata is valid, not uninitialized memory).
    fresh = nn.Sequential(fp8state.Linear(32, 64), nn.GELU(), fp8state.LayerNormMLP(64, 128))
    fp8state.checkpoint.load_state_dict(fresh, model.state_dict())


def test_to_empty_keeps_metadata_that_was_not_on_meta() -> None:
    layer = fp8state.Linear(16, 16)
    with fp8state.fp8_autocast():
        layer(torch.randn(4, 16))
    before = [t.clone() for t in layer.fp8_meta("fwd")]
    layer.to(torch.float64).to(torch.float32)  # moves and casts: never a reset
    assert all(torch.equal(a, b) for a, b in zip(before, layer.fp8_meta("fwd"), strict=True))


def test_reset_meta_forgets_history_and_opens_a_new_step() -> None:
    layer = fp8state.Linear(16, 16)
    for _ in range(2):
        with fp8state.fp8_autocast():
            layer(torch.randn(4, 16) * 50).sum().backward()
    assert not _fresh_metadata(layer)
    layer.fp8_reset_meta()
    assert _fresh_metadata(layer)
    with fp8state.fp8_autocast():
        layer(torch.full((4, 16), 2.0))
    hist = layer.fp8_meta("fwd").amax_history
    assert hist[0, 0] == 2.0 and torch.equal(hist[1:], torch.zeros_like(hist[1:]))
