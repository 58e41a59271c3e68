"""Activation checkpointing around fp8state modules: each recomputation replays its forward.

With ``torch.utils.checkpoint`` (both ways) and fp8state's drop-in ``activation_checkpoint``,
losses, input and weight gradients and every FP8 buffer of both directions are bit-identical
to the same steps without checkpointing, over several steps, with ``fp8_autocast`` outside or
inside the checkpointed function. Where PyTorch's checkpoint cannot tell which pending
forward a recomputation belongs to, RecomputationError; the drop-in is exact there too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _helpers.checkpointing import MODES, checkpointed
from _helpers.models import TwoGemm
from _helpers.state import assert_same
from torch import nn
from torch.autograd.graph import save_on_cpu

import fp8state
from fp8state.errors import RecomputationError
from fp8state.functional import activation_checkpoint, fp8_linear

H = 32
STEPS = 3
FIELDS = ("amax_history", "scale", "scale_inv")


class TwoProjections(fp8state.FP8StateMixin):
    """A user module on the mixin: two GEMMs through fp8state.functional.fp8_linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(2 * H, H) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(H, 2 * H) / H**0.5)
        self.init_fp8_meta(num_gemms=2)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return fp8_linear(self, F.relu(fp8_linear(self, x, self.w1, gemm=0)), self.w2, gemm=1)


def _block() -> nn.Module:
    """Norms and FP8 layers in one checkpointed block."""
    return nn.Sequential(
        fp8state.RMSNorm(H),
        fp8state.LayerNormLinear(H, 2 * H, normalization="RMSNorm"),
        nn.GELU(),
        fp8state.Linear(2 * H, H),
        fp8state.LayerNorm(H),
    )


KINDS: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: fp8state.Linear(H, H),
    "LayerNormLinear": lambda: fp8state.LayerNormLinear(H, H),
    "LayerNormMLP-gelu-fused": lambda: fp8state.LayerNormMLP(H, 2 * H),
    "LayerNormMLP-gelu-per-gemm": lambda: fp8state.LayerNormMLP(H, 2 * H),  # unfused: _build
    "LayerNormMLP-swiglu": lambda: fp8state.LayerNormMLP(
        H, 2 * H, activation="swiglu", normalization="RMSNorm"
    ),
    "user-module": TwoProjections,
    "block-with-norms": _block,
}


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = KINDS[kind]()
    if kind == "LayerNormMLP-gelu-per-gemm":
        model.fp8_fuse_activation = False  # fc1, GELU and fc2 as separate steps
    for module in model.modules():
        if isinstance(module, fp8state.FP8StateMixin):
            module.fp8_min_gemm_macs = 0  # FP8 even at these sizes
    return model


def _inputs(step: int, count: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [
        (torch.randn(16, H, generator=gen) * (1 + i + step)).requires_grad_() for i in range(count)
    ]


def _observe(model: nn.Module, losses: list[torch.Tensor], inputs: list[torch.Tensor]) -> dict:
    """What must not change: losses, gradients, every FP8 buffer; then one SGD step."""
    seen: dict[str, Any] = {f"loss{i}": loss.detach() for i, loss in enumerate(losses)}
    seen.update({f"input{i}.grad": x.grad for i, x in enumerate(inputs)})
    seen.update({f"{n}.grad": p.grad for n, p in model.named_parameters()})
    for name, module in model.named_modules():
        if isinstance(module, fp8state.FP8StateMixin):
            for direction in ("fwd", "bwd"):
                for field, t in zip(FIELDS, module.fp8_meta(direction), strict=True):
                    seen[f"{name}.{direction}.{field}"] = t.clone()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return seen


Body = Callable[[nn.Module, str, int], tuple[list[torch.Tensor], list[torch.Tensor]]]


def _train(kind: str, mode: str, body: Body, steps: int = STEPS) -> list[dict]:
    """What each step computed; ``body(model, mode, step)`` runs it, returns its losses and
    inputs."""
    model = _build(kind)
    return [_observe(model, *body(model, mode, step)) for step in range(steps)]


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


def _one_step(model: nn.Module, mode: str, step: int, inside: bool = False) -> tuple:
    (x,) = _inputs(step)

    def fn(t: torch.Tensor) -> torch.Tensor:
        with fp8state.fp8_autocast() if inside else contextlib.nullcontext():
            return model(t)

    with contextlib.nullcontext() if inside else fp8state.fp8_autocast():
        loss = _loss(checkpointed(mode, fn, x))
    loss.backward()
    return [loss], [x]


@functools.cache
def _reference(kind: str, inside: bool) -> list[dict]:
    return _train(kind, "none", functools.partial(_one_step, inside=inside))


@pytest.mark.parametrize("inside", [False, True], ids=["autocast-outside", "inside"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_recomputation_is_bit_identical(kind: str, mode: str, inside: bool) -> None:
    body = functools.partial(_one_step, inside=inside)
    assert_same(_reference(kind, inside), _train(kind, mode, body))


@pytest.mark.parametrize("mode", MODES)
def test_each_amax_is_recorded_once_per_step_and_the_replay_runs_fp8(mode: str) -> None:
    model = _build("LayerNormMLP-gelu-fused")
    for step in range(STEPS):
        (x,) = _inputs(step)
        with fp8state.fp8_autocast():
            y = checkpointed(mode, model, x)
        model.fp8_last_gemm_backend = "cleared"
        y.sum().backward()
        assert model.fp8_last_gemm_backend == "emulated"  # the recomputation ran in FP8
    for direction in ("fwd", "bwd"):
        hist = model.fp8_meta(direction).amax_history
        used = [0, 1, 3, 4] if direction == "fwd" else [0, 2]  # inputs, weights; gradients
        assert (hist[:STEPS, used] > 0).all() and not hist[STEPS:].any()


def _micro_batches(model: nn.Module, mode: str, step: int, *, each: bool, one: bool) -> tuple:
    """Three micro-batches with is_first_microbatch: a backward ``each`` or one for all, under
    ``one`` fp8_autocast or one each (scales update between them)."""
    inputs, losses = _inputs(step, 3), []
    with fp8state.fp8_autocast() if one else contextlib.nullcontext():
        for i, x in enumerate(inputs):
            run = functools.partial(model, is_first_microbatch=i == 0)
            with contextlib.nullcontext() if one else fp8state.fp8_autocast():
                losses.append(_loss(checkpointed(mode, run, x)))
            if each:
                losses[-1].backward()
    if not each:
        torch.stack(losses).sum().backward()
    return losses, inputs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("each", "one"),
    [(True, False), (True, True), (False, True)],
    ids=["backward-each-autocast-each", "backward-each-one-autocast", "one-backward-one-autocast"],
)
def test_micro_batches(mode: str, each: bool, one: bool) -> None:
    body = functools.partial(_micro_batches, each=each, one=one)
    kind = "LayerNormMLP-gelu-fused"
    assert_same(_train(kind, "none", body), _train(kind, mode, body))


def _in_flight(model: nn.Module, mode: str, step: int, *, one_backward: bool) -> tuple:
    """Two forwards, each in its own fp8_autocast (scales update in between), before their
    backwards: one backward of both, or one each in forward order (a pipeline schedule)."""
    inputs, losses = _inputs(step, 2), []
    for x in inputs:
        with fp8state.fp8_autocast():
            losses.append(_loss(checkpointed(mode, model, x)))
    for loss in [torch.stack(losses).sum()] if one_backward else losses:
        loss.backward()
    return losses, inputs


@pytest.mark.parametrize("one_backward", [False, True], ids=["pipeline", "one-backward"])
@pytest.mark.parametrize("mode", ["torch-reentrant", "drop-in-reentrant", "drop-in"])
def test_forwards_in_flight_with_other_scales_replay_their_own(
    mode: str, one_backward: bool
) -> None:
    body = functools.partial(_in_flight, one_backward=one_backward)
    assert_same(_train("Linear", "none", body), _train("Linear", mode, body))


@pytest.mark.parametrize("one_backward", [False, True], ids=["pipeline", "one-backward"])
def test_non_reentrant_torch_checkpoint_refuses_ambiguous_recomputations(
    one_backward: bool,
) -> None:
    with pytest.raises(RecomputationError) as caught:
        _train("Linear", "torch", functools.partial(_in_flight, one_backward=one_backward))
    err = caught.value
    assert err.key == "Linear (GEMM 0)"
    assert "2 forwards awaiting recomputation" in err.found
    assert "fp8state.functional.activation_checkpoint" in err.fix


def _shared(model: nn.Module, mode: str, step: int) -> tuple:
    """One module in two checkpointed segments of a step (weight sharing)."""
    (x,) = _inputs(step)
    with fp8state.fp8_autocast():
        loss = _loss(checkpointed(mode, model, torch.tanh(checkpointed(mode, model, x))))
    loss.backward()
    return [loss], [x]


@pytest.mark.parametrize("mode", MODES)
def test_a_module_in_several_checkpoints_of_one_step(mode: str) -> None:
    # Reentrant checkpoints backpropagate each segment in a backward pass of its own: the
    # backward scale update still waits for the end of the outer pass.
    kind = "LayerNormMLP-gelu-fused"
    assert_same(_train(kind, "none", _shared), _train(kind, mode, _shared))


def _nested(model: nn.Module, mode: str, step: int) -> tuple:
    """A checkpoint inside a checkpointed function."""
    (x,) = _inputs(step)
    with fp8state.fp8_autocast():
        outer = lambda t: model(checkpointed(mode, model, t) * 0.5)  # noqa: E731
        loss = _loss(checkpointed(mode, outer, x))
    loss.backward()
    return [loss], [x]


@pytest.mark.parametrize("mode", ["drop-in-reentrant", "drop-in"])
def test_drop_in_checkpoints_nest(mode: str) -> None:
    assert_same(_train("Linear", "none", _nested), _train("Linear", mode, _nested))


@pytest.mark.parametrize("mode", ["torch-reentrant", "torch"])
def test_nested_torch_checkpoints_raise(mode: str) -> None:
    with pytest.raises(RecomputationError, match="no record of its forward"):
        _train("Linear", mode, _nested)


def _retained(model: nn.Module, mode: str, step: int) -> tuple:
    (x,) = _inputs(step)
    with fp8state.fp8_autocast():
        loss = _loss(checkpointed(mode, model, x))
    loss.backward(retain_graph=True)
    loss.backward()  # a second recomputation of the same forward
    return [loss], [x]


@pytest.mark.parametrize("mode", ["drop-in-reentrant", "drop-in"])
def test_drop_in_recomputes_a_retained_graph_again(mode: str) -> None:
    assert_same(_train("Linear", "none", _retained), _train("Linear", mode, _retained))


@pytest.mark.parametrize("mode", ["torch-reentrant", "torch"])
def test_torch_checkpoint_refuses_a_second_recomputation(mode: str) -> None:
    with pytest.raises(RecomputationError, match="activation_checkpoint"):
        _train("Linear", mode, _retained)


def test_reentrant_torch_checkpoint_in_eval_mode_raises_and_the_drop_in_works() -> None:
    results = {}
    for mode in ("none", "drop-in-reentrant", "torch-reentrant"):
        model = _build("Linear").eval()
        (x,) = _inputs(0)
        with fp8state.fp8_autocast():
            loss = _loss(checkpointed(mode, model, x))
        if mode == "torch-reentrant":
            with pytest.raises(RecomputationError, match="eval mode"):
                loss.backward()
        else:
            loss.backward()
            results[mode] = _observe(model, [loss], [x])
    assert_same(results["none"], results["drop-in-reentrant"])


def _high_precision(model: nn.Module, mode: str, step: int, *, calibrating: bool) -> tuple:
    (x,) = _inputs(step)
    with fp8state.fp8_autocast(enabled=False, calibrating=calibrating):
        loss = _loss(checkpointed(mode, model, x))
    loss.backward(retain_graph=not calibrating)
    if not calibrating:
        loss.backward()  # even a second recomputation: there is nothing FP8 to replay
    return [loss], [x]


@pytest.mark.parametrize("calibrating", [False, True], ids=["no-fp8", "calibrating"])
@pytest.mark.parametrize("mode", MODES)
def test_high_precision_recomputation_records_nothing(mode: str, calibrating: bool) -> None:
    body = functools.partial(_high_precision, calibrating=calibrating)
    kind = "block-with-norms"
    assert_same(_train(kind, "none", body), _train(kind, mode, body))


def _cache_replaced(model: nn.Module, mode: str, step: int) -> tuple:
    """A later is_first_microbatch=True forward replaces the FP8 weight that an earlier
    micro-batch's forward reused, before that micro-batch's backward."""
    inputs, losses = _inputs(step, 3), []
    for i, x in enumerate(inputs):
        with fp8state.fp8_autocast():
            run = functools.partial(model, is_first_microbatch=i != 1)
            losses.append(_loss(checkpointed(mode, run, x)))
    for loss in losses:
        loss.backward()
    return losses, inputs


@pytest.mark.parametrize("mode", ["drop-in-reentrant", "drop-in"])
def test_drop_in_keeps_the_cached_weight_its_forward_reused(mode: str) -> None:
    expected = _train("Linear", "none", _cache_replaced, steps=1)
    assert_same(expected, _train("Linear", mode, _cache_replaced, steps=1))


@pytest.mark.parametrize(
    ("mode", "found"),
    [("torch-reentrant", "cached FP8 weight .* was replaced"), ("torch", "3 forwards awaiting")],
)
def test_torch_checkpoint_refuses_a_replaced_cached_weight(mode: str, found: str) -> None:
    with pytest.raises(RecomputationError, match=found):
        _train("Linear", mode, _cache_replaced, steps=1)


def _under_hooks_or_no_grad(model: nn.Module, mode: str, step: int, *, offload: bool) -> tuple:
    """The checkpoint under save_on_cpu (Hugging Face's offload=True), or an FP8 call under
    no_grad inside the checkpointed function."""
    (x,) = _inputs(step)

    def fn(t: torch.Tensor) -> torch.Tensor:
        if offload:
            return model(t)
        with torch.no_grad():
            gate = torch.sigmoid(model(t))
        return model(t * gate)

    with fp8state.fp8_autocast(), save_on_cpu() if offload else contextlib.nullcontext():
        loss = _loss(checkpointed(mode, fn, x))
    loss.backward()
    return [loss], [x]


@pytest.mark.parametrize("offload", [True, False], ids=["under-save_on_cpu", "no_grad-inside"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_under_hooks_and_no_grad_inside(mode: str, offload: bool) -> None:
    body = functools.partial(_under_hooks_or_no_grad, offload=offload)
    kind = "LayerNormMLP-gelu-fused"
    assert_same(_train(kind, "none", body), _train(kind, mode, body))


def test_drop_in_refuses_a_recomputation_that_runs_other_calls() -> None:
    # Reentrant: the whole function runs again (a non-reentrant recomputation stops as soon as
    # it has rebuilt what the forward saved, here after the first call).
    model = _build("Linear")
    runs = []

    def data_dependent(t: torch.Tensor) -> torch.Tensor:
        runs.append(None)
        return model(model(t) if len(runs) > 1 else t)  # one call more when recomputed

    with fp8state.fp8_autocast():
        y = activation_checkpoint(data_dependent, _inputs(0)[0], use_reentrant=True)
    with pytest.raises(RecomputationError, match="call 2 of the module") as caught:
        y.sum().backward()
    assert caught.value.key == "Linear (GEMM 0)"


@pytest.mark.parametrize("mode", MODES)
def test_a_module_recording_its_own_forward_amaxes_is_refused(mode: str) -> None:
    model = TwoGemm(hidden=H)  # records through fp8_record_amax, not fp8state.functional
    with pytest.raises(RecomputationError, match="fp8_linear") as caught:
        checkpointed(mode, model, _inputs(0)[0]).sum().backward()
    assert caught.value.key == "TwoGemm.fp8_record_amax"


def test_training_without_checkpoints_keeps_no_records() -> None:
    model = _build("LayerNormMLP-gelu-fused")
    for step in range(2):
        with fp8state.fp8_autocast():
            model(_inputs(step)[0]).sum().backward()
    assert "_fp8_replay_log" not in model.__dict__  # the hot path keeps nothing
