"""``tune_fallback``: the step's GEMM sizes as candidates, the fastest kept, the model as it was."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from _helpers.state import assert_same, assert_unchanged, snapshot
from torch import nn

import fp8state
from fp8state.errors import ConfigError

TOKENS, H = 16, 64
SLOW_S = 0.03  # far above a CPU step of these layers (about a millisecond)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(fp8state.Linear(H, H), fp8state.Linear(H, H // 2))


def _step(model: nn.Module, x: torch.Tensor, after: Callable[[], None] = lambda: None):
    def step() -> None:
        with fp8state.fp8_autocast():
            out = model(x)
        after()
        out.sum().backward()

    return step


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_candidates_are_the_steps_gemm_sizes_and_the_choice_is_set():
    model = _model()
    x = torch.randn(TOKENS, H)
    tuning = fp8state.tune_fallback(model, _step(model, x), steps=1, repeats=1, warmup=0)
    small, large = TOKENS * H * (H // 2), TOKENS * H * H
    assert tuning.gemm_macs == (small, large)
    assert set(tuning.ms_per_step) == {small, large, large + 1}
    assert all(ms > 0 for ms in tuning.ms_per_step.values())
    assert tuning.modules == ("0", "1")
    assert [m.fp8_min_gemm_macs for m in model] == [tuning.chosen] * 2
    assert tuning.fp8_gemm_macs(large) == (large,)
    assert tuning.fp8_gemm_macs(large + 1) == ()


@pytest.mark.parametrize("slow_when", ["large_falls_back", "small_runs_fp8"])
def test_the_fastest_threshold_wins(slow_when: str):
    """A step made slow under some thresholds: the tuner keeps one of the others."""
    model = _model()
    large_module, small_module = model[0], model[1]  # 64 -> 64, then 64 -> 32

    def slow() -> None:
        if slow_when == "large_falls_back":
            hit = large_module.fp8_last_gemm_backend == "high_precision"
        else:
            hit = small_module.fp8_last_gemm_backend != "high_precision"
        if hit:
            time.sleep(SLOW_S)

    x = torch.randn(TOKENS, H)
    tuning = fp8state.tune_fallback(model, _step(model, x, slow), steps=2, repeats=2, warmup=1)
    small, large = tuning.gemm_macs
    fast = {small, large} if slow_when == "large_falls_back" else {large, large + 1}
    assert tuning.chosen in fast
    for threshold in set(tuning.ms_per_step) - fast:
        assert tuning.ms_per_step[threshold] > tuning.ms_per_step[tuning.chosen] + SLOW_S * 1e3 / 2


def test_the_model_is_left_as_it_was_but_for_the_threshold():
    """FP8 metadata and step flags, weight caches, other buffers, gradients and the random
    generator: all as before; ``apply=False`` keeps the thresholds too."""
    torch.manual_seed(0)
    model = nn.Sequential(
        fp8state.LayerNormMLP(H, 2 * H),
        nn.BatchNorm1d(H),
        nn.Dropout(0.5),
        fp8state.Linear(H, H // 2),
    )
    x = torch.randn(TOKENS, H)
    step = _step(model, x)
    step()  # metadata, grads and BatchNorm statistics that are not the initial ones
    with fp8state.fp8_autocast():
        model[3](x, is_first_microbatch=True)  # a cached FP8 weight
    cached = model[3].fp8_weight_cache
    cache = {k: [t.clone() for t in v if t is not None] for k, v in cached.items()}
    before, grads, rng = snapshot(model), _grads(model), torch.random.get_rng_state()
    for apply in (False, True):
        tuning = fp8state.tune_fallback(model, step, steps=1, repeats=2, warmup=1, apply=apply)
        assert_unchanged(model, before)
        assert_same(_grads(model), grads)
        assert_same(torch.random.get_rng_state(), rng)
        kept = {k: [t for t in v if t is not None] for k, v in model[3].fp8_weight_cache.items()}
        assert_same(kept, cache)
        thresholds = [model[0].fp8_min_gemm_macs, model[3].fp8_min_gemm_macs]
        assert thresholds == ([tuning.chosen] * 2 if apply else [None, None])
    assert tuning.gemm_macs == (TOKENS * H * (H // 2), TOKENS * H * 2 * H)


def test_a_step_that_updates_parameters_is_refused_and_the_metadata_put_back():
    model = _model()
    x = torch.randn(TOKENS, H)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = _step(model, x)
    plain()
    before = {n: m.fp8_state() for n, m in model.named_children()}
    copies = {n: [t.clone() for d in (s.fwd, s.bwd) for t in d] for n, s in before.items()}

    def with_optimizer() -> None:
        plain()
        optimizer.step()

    with pytest.raises(ConfigError, match=r"changed parameter '0\.weight' in place"):
        fp8state.tune_fallback(model, with_optimizer, steps=1, repeats=1, warmup=0)
    for n, m in model.named_children():
        state = m.fp8_state()
        assert_same([t for d in (state.fwd, state.bwd) for t in d], copies[n])
        assert m.fp8_min_gemm_macs is None


def test_an_error_in_the_step_propagates_and_puts_everything_back():
    model = _model()
    x = torch.randn(TOKENS, H)
    plain = _step(model, x)
    plain()
    before, grads = snapshot(model), _grads(model)
    calls = iter(range(100))

    def failing() -> None:
        if next(calls) == 4:
            raise RuntimeError("the data loader ran dry")
        plain()

    with pytest.raises(RuntimeError, match="ran dry"):
        fp8state.tune_fallback(model, failing, steps=2, repeats=2, warmup=1)
    assert_unchanged(model, before)
    assert_same(_grads(model), grads)
    assert [m.fp8_min_gemm_macs for m in model] == [None, None]


def test_a_step_without_fp8_autocast_is_refused():
    model = _model()
    x = torch.randn(TOKENS, H)
    with pytest.raises(ConfigError, match="ran no eager FP8 GEMM under fp8_autocast"):
        fp8state.tune_fallback(model, lambda: model(x).sum().backward())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, r"steps=\.\.\.\): found 0"),
        ({"repeats": True}, r"repeats=\.\.\.\): found True"),
        ({"warmup": -1}, r"warmup=\.\.\.\): found -1"),
    ],
)
def test_bad_counts_are_refused(kwargs: dict, match: str):
    model = _model()
    with pytest.raises(ConfigError, match=match):
        fp8state.tune_fallback(model, _step(model, torch.randn(TOKENS, H)), **kwargs)


def test_models_without_eager_fp8_modules_are_refused():
    plain = nn.Linear(H, H)
    with pytest.raises(ConfigError, match="0 FP8 modules"):
        fp8state.tune_fallback(plain, lambda: None)
    model = _model()
    for m in model:
        m.fp8_graphed = True
    with pytest.raises(ConfigError, match="2 FP8 modules, 2 of them graphed"):
        fp8state.tune_fallback(model, lambda: None)
    with pytest.raises(ConfigError, match="a torch.nn.Module"):
        fp8state.tune_fallback(object(), lambda: None)  # type: ignore[arg-type]


def test_a_call_inside_fp8_autocast_is_refused():
    model = _model()
    with fp8state.fp8_autocast(), pytest.raises(ConfigError, match="inside fp8_autocast"):
        fp8state.tune_fallback(model, _step(model, torch.randn(TOKENS, H)))


def test_a_history_grown_by_the_steps_recipe_keeps_the_saved_rows_on_top():
    model = _model()
    x = torch.randn(TOKENS, H)
    _step(model, x)()
    saved = [t.clone() for t in model[0].fp8_meta("fwd")]
    rows = saved[0].shape[0]
    longer = fp8state.DelayedScaling(amax_history_len=2 * rows)

    def step() -> None:
        with fp8state.fp8_autocast(fp8_recipe=longer):
            out = model(x)
        out.sum().backward()

    with pytest.warns(UserWarning, match="rows"):
        fp8state.tune_fallback(model, step, steps=1, repeats=1, warmup=0)
    history, scale, scale_inv = model[0].fp8_meta("fwd")
    assert history.shape[0] == 2 * rows
    assert_same(history[:rows], saved[0])
    assert not history[rows:].any()
    assert_same([scale, scale_inv], saved[1:])
