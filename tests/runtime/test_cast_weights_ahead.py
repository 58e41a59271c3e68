"""``fp8state.cast_weights_ahead``: a step's weights cast before its forwards, reused by them.

A step inside the block computes, records and learns exactly what the same step computes
without it: outputs, gradients and FP8 metadata bit for bit, over steps whose weights change,
with micro-batches and with activation checkpointing. Where a weight cast ahead is not
multiplied in FP8 inside the block, its end raises; bad arguments raise before anything is
cast.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from _helpers.state import assert_state_equal, assert_unchanged, snapshot
from torch import nn

import fp8state
from fp8state.errors import ConfigError

H = 32
TOKENS = 2 * 8


class _Block(nn.Module):
    """Every FP8 GEMM module, called without ``is_first_microbatch`` as most code does."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = fp8state.LayerNormLinear(H, 2 * H)
        self.proj = fp8state.Linear(2 * H, H)
        self.mlp = fp8state.LayerNormMLP(H, 2 * H)  # GELU: both GEMMs in one fused call
        self.relu_mlp = fp8state.LayerNormMLP(H, 2 * H, activation="relu")  # one call a GEMM
        self.conv = fp8state.Conv1D(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.qkv(x))
        x = x + self.mlp(x)
        return self.conv(x + self.relu_mlp(x))


def _twins(build: Callable[[], nn.Module] = _Block) -> tuple[nn.Module, nn.Module]:
    a, b = build(), build()
    b.load_state_dict(a.state_dict())
    return a, b


def _assert_same_step(a: nn.Module, b: nn.Module, ya: torch.Tensor, yb: torch.Tensor) -> None:
    assert torch.equal(ya, yb)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert_state_equal(a, b)


def _sgd(*models: nn.Module) -> None:
    """A step of plain SGD: the next step's weights differ, and so must their casts."""
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None


def test_steps_are_the_plain_steps_bit_for_bit(seed: int) -> None:
    plain, ahead = _twins()
    for step in range(4):
        x = torch.randn(2, 8, H) * (step + 1)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fp8state.fp8_autocast():
            ya = plain(xa)
        with fp8state.fp8_autocast():
            with fp8state.cast_weights_ahead(ahead, tokens=TOKENS):
                yb = ahead(xb)
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad), step
        _assert_same_step(plain, ahead, ya, yb)
        _sgd(plain, ahead)


def test_the_block_casts_before_any_forward_and_each_call_reuses_its_copy(seed: int) -> None:
    model = _Block()
    x = torch.randn(TOKENS, H)
    with fp8state.fp8_autocast():
        with fp8state.cast_weights_ahead(model, tokens=TOKENS):
            kept = {id(m): dict(m.fp8_weight_cache) for m in model.children()}
            assert [len(kept[id(m)]) for m in model.children()] == [1, 1, 2, 2, 1]
            history = model.proj.fp8_meta("fwd").amax_history.clone()
            assert history[0, 1] == model.proj.weight.abs().max()  # recorded ahead
            assert history[0, 0] == 0  # the input's record waits for the call
            model(x)
            for m in model.children():  # nothing cast again: the same copies
                assert all(m.fp8_weight_cache[g] is c for g, c in kept[id(m)].items())


def test_micro_batches_reuse_the_copies_as_later_micro_batches_do(seed: int) -> None:
    given, ahead = _twins()
    batches = [torch.randn(TOKENS, H) * (i + 1) for i in range(3)]
    with fp8state.fp8_autocast():
        outs_given = [
            given.proj(given.qkv(x, is_first_microbatch=i == 0), is_first_microbatch=i == 0)
            for i, x in enumerate(batches)
        ]
    with fp8state.fp8_autocast():
        with fp8state.cast_weights_ahead([ahead.qkv, ahead.proj], tokens=TOKENS):
            outs_ahead = [ahead.proj(ahead.qkv(x)) for x in batches]
    sum(o.sum() for o in outs_given).backward()
    sum(o.sum() for o in outs_ahead).backward()
    for og, oa in zip(outs_given, outs_ahead, strict=True):
        assert torch.equal(og, oa)
    for m in ("qkv", "proj"):
        _assert_same_step(getattr(given, m), getattr(ahead, m), outs_given[0], outs_ahead[0])


@pytest.mark.parametrize(
    "checkpoint",
    [
        functools.partial(fp8state.activation_checkpoint, use_reentrant=False),
        functools.partial(fp8state.activation_checkpoint, use_reentrant=True),
        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
    ],
    ids=["non-reentrant", "reentrant", "torch-non-reentrant"],
)
def test_activation_checkpointing_recomputes_with_the_copies(
    seed: int, checkpoint: Callable[..., torch.Tensor]
) -> None:
    plain, ahead = _twins()
    for _ in range(3):
        x = torch.randn(TOKENS, H, requires_grad=True)
        ys = []
        # The plain twin's block casts nothing: its calls run as they would without one.
        for model, cast in ((plain, []), (ahead, ahead)):
            with fp8state.fp8_autocast():
                with fp8state.cast_weights_ahead(cast, tokens=TOKENS):
                    ys.append(checkpoint(model, x))
            ys[-1].square().sum().backward()
        _assert_same_step(plain, ahead, *ys)
        _sgd(plain, ahead)


def test_the_copies_stay_cached_until_the_next_block_replaces_them(seed: int) -> None:
    model = fp8state.Linear(H, H)
    copies = []
    for _ in range(2):
        with fp8state.fp8_autocast():
            with fp8state.cast_weights_ahead(model, tokens=TOKENS):
                model(torch.randn(TOKENS, H))
        copies.append(model.fp8_weight_cache[0])
    assert copies[0] is not copies[1]
    assert all(t is not None for t in copies[1])  # with the transpose: gradients were on
    with torch.no_grad(), fp8state.fp8_autocast():
        with fp8state.cast_weights_ahead(model, tokens=TOKENS):
            assert model.fp8_weight_cache[0][1] is None  # none without gradients
            model(torch.randn(TOKENS, H))


def test_gemms_below_the_threshold_are_not_cast_and_fall_back_as_usual(seed: int) -> None:
    plain, ahead = _twins()
    for model in (plain, ahead):
        model.proj.fp8_min_gemm_macs = TOKENS * H * 2 * H + 1  # proj falls back at TOKENS
    x = torch.randn(TOKENS, H)
    with fp8state.fp8_autocast():
        ya = plain(x)
    with fp8state.fp8_autocast():
        with fp8state.cast_weights_ahead(ahead, tokens=TOKENS):
            assert not ahead.proj.fp8_weight_cache and ahead.qkv.fp8_weight_cache
            yb = ahead(x)
    ya.sum().backward()
    yb.sum().backward()
    assert ahead.proj.fp8_last_gemm_backend == "high_precision"
    _assert_same_step(plain, ahead, ya, yb)


def test_a_weight_cast_ahead_that_no_fp8_call_took_raises_at_the_end(seed: int) -> None:
    model = _Block()
    model.proj.fp8_min_gemm_macs = TOKENS * H * 2 * H  # FP8 at TOKENS, not at fewer
    with fp8state.fp8_autocast():
        with pytest.raises(ConfigError) as err:
            with fp8state.cast_weights_ahead(model, tokens=TOKENS):
                model(torch.randn(TOKENS // 2, H))  # proj falls back at these tokens
    assert err.value.key == "proj"
    assert "16 tokens" in err.value.found
    with fp8state.fp8_autocast():
        with pytest.raises(ConfigError) as err:
            with fp8state.cast_weights_ahead(model, tokens=TOKENS):
                model.qkv(torch.randn(TOKENS, H))  # the rest never called
    assert err.value.key == "conv, mlp, proj, relu_mlp"


def test_an_error_inside_the_block_propagates_and_closes_it(seed: int) -> None:
    model = _Block()
    with fp8state.fp8_autocast():
        with pytest.raises(ZeroDivisionError):
            with fp8state.cast_weights_ahead(model, tokens=TOKENS):
                _ = 1 / 0
    with fp8state.fp8_autocast():  # not "a block inside another"
        with fp8state.cast_weights_ahead(model, tokens=TOKENS):
            model(torch.randn(TOKENS, H))


def test_a_compiled_call_inside_the_block_raises(seed: int) -> None:
    model = fp8state.Linear(H, H)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with fp8state.fp8_autocast():
        with pytest.raises(ConfigError, match="cast_weights_ahead block"):
            with fp8state.cast_weights_ahead(model, tokens=TOKENS):
                compiled(torch.randn(TOKENS, H))


@pytest.mark.parametrize("enabled", [None, False])
def test_without_fp8_compute_the_block_does_nothing(seed: int, enabled: bool | None) -> None:
    model = _Block()
    before = snapshot(model)
    x = torch.randn(TOKENS, H)
    want = model(x)
    if enabled is None:
        with fp8state.cast_weights_ahead(model, tokens=TOKENS):
            got = model(x)
        assert torch.equal(got, want)
        assert_unchanged(model, before)
    else:  # calibrating: the calls record as usual, the block casts nothing
        with fp8state.fp8_autocast(enabled=False, calibrating=True):
            with fp8state.cast_weights_ahead(model, tokens=TOKENS):
                assert not model.proj.fp8_weight_cache
                model(x)


class _Sub(torch.Tensor):
    """A tensor subclass, as FSDP2's sharded weights are."""


class _Custom(fp8state.FP8StateMixin):
    """A module of the user's own with one GEMM, cast ahead through ``fp8_gemm_weights``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.init_fp8_meta(num_gemms=1)

    def fp8_gemm_weights(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8state.functional.fp8_linear(self, x, self.weight)


def test_a_module_of_your_own_is_cast_ahead_through_its_gemm_weights(seed: int) -> None:
    plain, ahead = _Custom(torch.randn(H, H)), _Custom(torch.randn(H, H))
    ahead.load_state_dict(plain.state_dict())
    x = torch.randn(TOKENS, H)
    with fp8state.fp8_autocast():
        ya = plain(x)
    with fp8state.fp8_autocast():
        with fp8state.cast_weights_ahead(ahead, tokens=TOKENS):
            assert ahead.fp8_weight_cache
            yb = ahead(x)
    ya.sum().backward()
    yb.sum().backward()
    _assert_same_step(plain, ahead, ya, yb)


@pytest.mark.parametrize(
    ("tokens", "fragment"), [(0, "positive int"), (True, "positive int"), (2.0, "positive int")]
)
def test_bad_tokens_raise_before_anything_is_cast(seed: int, tokens: object, fragment: str) -> None:
    model = _Block()
    before = snapshot(model)
    with fp8state.fp8_autocast():
        with pytest.raises(ConfigError, match=fragment):
            with fp8state.cast_weights_ahead(model, tokens=tokens):  # type: ignore[arg-type]
                pass
    assert_unchanged(model, before)


def test_a_weight_that_is_not_a_plain_tensor_raises_before_anything_is_cast(seed: int) -> None:
    model = nn.Sequential(fp8state.Linear(H, H), _Custom(torch.randn(H, H).as_subclass(_Sub)))
    before = snapshot(model)
    with fp8state.fp8_autocast():
        with pytest.raises(ConfigError, match="_Sub") as err:
            with fp8state.cast_weights_ahead(model, tokens=TOKENS):
                pass
    assert err.value.key == "1 (GEMM 0)"
    assert_unchanged(model, before)
    assert not model[0].fp8_weight_cache


def test_a_block_inside_another_raises_before_casting(seed: int) -> None:
    outer, inner = fp8state.Linear(H, H), fp8state.Linear(H, H)
    before = snapshot(inner)
    with fp8state.fp8_autocast():
        with fp8state.cast_weights_ahead(outer, tokens=TOKENS):
            with pytest.raises(ConfigError, match="inside another"):
                with fp8state.cast_weights_ahead(inner, tokens=TOKENS):
                    pass
            outer(torch.randn(TOKENS, H))
    assert_unchanged(inner, before)
