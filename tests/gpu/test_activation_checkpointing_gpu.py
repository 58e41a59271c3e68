"""Activation checkpointing on a GPU: recomputations replay their forwards bit for bit.

The CUDA mirror of tests/mixin/test_activation_checkpointing.py: bf16 modules, the fused
Triton casts (a replay casts with its forward's scales into a scratch history), the GELU cast
kernel, the one-byte transpose of a cached weight, and ``torch._scaled_mm`` where the GPU has
FP8 tensor cores (the emulation elsewhere). Losses, gradients and every FP8 buffer match the
same steps without checkpointing. Skipped without CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _helpers.checkpointing import MODES, checkpointed
from _helpers.state import assert_same
from torch import nn

import fp8state
from fp8state.backends import resolve_backend
from fp8state.errors import RecomputationError
from fp8state.functional import fp8_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]

CUDA = torch.device("cuda")
H = 64  # multiples of 16: torch._scaled_mm's alignment
STEPS = 3
FIELDS = ("amax_history", "scale", "scale_inv")


class TwoProjections(fp8state.FP8StateMixin):
    """A user module on the mixin: two GEMMs through fp8state.functional.fp8_linear."""

    def __init__(self) -> None:
        super().__init__()
        kw = {"device": CUDA, "dtype": torch.bfloat16}
        self.w1 = nn.Parameter(torch.randn(2 * H, H, **kw) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(H, 2 * H, **kw) / H**0.5)
        self.init_fp8_meta(num_gemms=2)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return fp8_linear(self, F.relu(fp8_linear(self, x, self.w1, gemm=0)), self.w2, gemm=1)


def _mlp(**kwargs: Any) -> nn.Module:
    return fp8state.LayerNormMLP(H, 2 * H, params_dtype=torch.bfloat16, device=CUDA, **kwargs)


def _unfused() -> nn.Module:
    mlp = _mlp()
    mlp.fp8_fuse_activation = False
    return mlp


KINDS: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: fp8state.Linear(H, H, params_dtype=torch.bfloat16, device=CUDA),
    "LayerNormLinear": lambda: fp8state.LayerNormLinear(
        H, H, params_dtype=torch.bfloat16, device=CUDA
    ),
    "LayerNormMLP-gelu-fused": _mlp,
    "LayerNormMLP-gelu-per-gemm": _unfused,
    "LayerNormMLP-swiglu": lambda: _mlp(activation="swiglu", normalization="RMSNorm"),
    "user-module": TwoProjections,
}


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = KINDS[kind]()
    for module in model.modules():
        if isinstance(module, fp8state.FP8StateMixin):
            module.fp8_min_gemm_macs = 0
    return model


def _inputs(step: int, count: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(step)
    return [
        (torch.randn(32, H, generator=gen, device=CUDA) * (1 + i + step))
        .to(torch.bfloat16)
        .requires_grad_()
        for i in range(count)
    ]


def _observe(model: nn.Module, losses: list[torch.Tensor], inputs: list[torch.Tensor]) -> dict:
    seen: dict[str, Any] = {f"loss{i}": loss.detach() for i, loss in enumerate(losses)}
    seen.update({f"input{i}.grad": x.grad for i, x in enumerate(inputs)})
    seen.update({f"{n}.grad": p.grad for n, p in model.named_parameters()})
    for name, module in model.named_modules():
        if isinstance(module, fp8state.FP8StateMixin):
            assert module.fp8_last_gemm_backend == resolve_backend("auto", CUDA)
            for direction in ("fwd", "bwd"):
                for field, t in zip(FIELDS, module.fp8_meta(direction), strict=True):
                    seen[f"{name}.{direction}.{field}"] = t.clone()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return seen


def _steps(kind: str, mode: str, autocast_inside: bool) -> list[dict]:
    model, seen = _build(kind), []
    for step in range(STEPS):
        (x,) = _inputs(step)
        if autocast_inside:

            def fn(t: torch.Tensor) -> torch.Tensor:
                with fp8state.fp8_autocast():
                    return model(t)

            y = checkpointed(mode, fn, x)
        else:
            with fp8state.fp8_autocast():
                y = checkpointed(mode, model, x)
        loss = y.float().pow(2).mean()
        loss.backward()
        seen.append(_observe(model, [loss], [x]))
    return seen


@functools.cache
def _reference(kind: str, autocast_inside: bool) -> list[dict]:
    return _steps(kind, "none", autocast_inside)


@pytest.mark.parametrize("autocast_inside", [False, True], ids=["autocast-outside", "inside"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_recomputation_is_bit_identical_on_gpu(kind: str, mode: str, autocast_inside: bool) -> None:
    assert_same(_reference(kind, autocast_inside), _steps(kind, mode, autocast_inside))


def _micro_batches(mode: str, *, one_autocast: bool) -> list[dict]:
    """Three micro-batches per step (is_first_microbatch), a backward each."""
    model, seen = _build("LayerNormMLP-gelu-fused"), []
    for step in range(STEPS):
        inputs, losses = _inputs(step, 3), []
        with fp8state.fp8_autocast() if one_autocast else contextlib.nullcontext():
            for i, x in enumerate(inputs):
                run = functools.partial(model, is_first_microbatch=i == 0)
                with contextlib.nullcontext() if one_autocast else fp8state.fp8_autocast():
                    losses.append(checkpointed(mode, run, x).float().pow(2).mean())
                losses[-1].backward()
        seen.append(_observe(model, losses, inputs))
    return seen


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("one_autocast", [False, True], ids=["autocast-each", "one-autocast"])
def test_micro_batches_on_gpu(mode: str, one_autocast: bool) -> None:
    expected = _micro_batches("none", one_autocast=one_autocast)
    assert_same(expected, _micro_batches(mode, one_autocast=one_autocast))


def _in_flight(mode: str) -> list[dict]:
    """Two forwards with a scale update between them, then their backwards in order."""
    model, seen = _build("LayerNormMLP-gelu-fused"), []
    for step in range(STEPS):
        inputs, losses = _inputs(step, 2), []
        for x in inputs:
            with fp8state.fp8_autocast():
                losses.append(checkpointed(mode, model, x).float().pow(2).mean())
        for loss in losses:
            loss.backward()
        seen.append(_observe(model, losses, inputs))
    return seen


@pytest.mark.parametrize("mode", ["torch-reentrant", "drop-in-reentrant", "drop-in"])
def test_forwards_in_flight_replay_their_own_on_gpu(mode: str) -> None:
    assert_same(_in_flight("none"), _in_flight(mode))


def test_non_reentrant_torch_checkpoint_refuses_ambiguity_on_gpu() -> None:
    with pytest.raises(RecomputationError, match="activation_checkpoint"):
        _in_flight("torch")


def _shared(mode: str) -> list[dict]:
    model, seen = _build("LayerNormMLP-gelu-fused"), []
    for step in range(STEPS):
        (x,) = _inputs(step)
        with fp8state.fp8_autocast():
            y = checkpointed(mode, model, torch.tanh(checkpointed(mode, model, x)))
        loss = y.float().pow(2).mean()
        loss.backward()
        seen.append(_observe(model, [loss], [x]))
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_a_module_in_several_checkpoints_on_gpu(mode: str) -> None:
    assert_same(_shared("none"), _shared(mode))
