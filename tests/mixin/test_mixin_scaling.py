"""FP8StateMixin's delayed-scaling bookkeeping: amax history order, per-step records, the scale
formula as saved, and recipe windows longer than the history."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from _helpers.models import Bare, TwoGemm, run_steps, save_load
from _helpers.state import assert_state_equal, fields

from fp8state.errors import FP8StateError
from fp8state.formats import Format
from fp8state.recipe import DelayedScaling


def test_row0_is_most_recent_and_first_record_shifts() -> None:
    m = Bare(1, history_rows=4)
    for step, amax in enumerate([1.0, 2.0, 3.0, 4.0, 5.0]):
        m.fp8_record_amax("fwd", 0, torch.tensor(amax))
        assert m.fp8_fwd_amax_history[0, 0].item() == amax, step
        m.fp8_update_scales("fwd")
    torch.testing.assert_close(
        m.fp8_fwd_amax_history[:, 0], torch.tensor([5.0, 4.0, 3.0, 2.0]), atol=0, rtol=0
    )


def test_records_within_a_step_take_the_max() -> None:
    m = Bare(1, history_rows=3)
    m.fp8_record_amax("fwd", 0, torch.tensor(1.0))
    m.fp8_update_scales("fwd")
    for amax in (3.0, 5.0, 2.0):  # micro-batches of one step
        m.fp8_record_amax("fwd", 0, torch.tensor(amax))
    m.fp8_record_amax("fwd", 1, torch.tensor(0.5))  # another slot, same step: no new shift
    want = torch.tensor([[5.0, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(m.fp8_fwd_amax_history, want, atol=0, rtol=0)


def test_directions_step_independently() -> None:
    m = Bare(1, history_rows=3)
    m.fp8_record_amax("fwd", 0, torch.tensor(1.0))
    m.fp8_update_scales("fwd")
    m.fp8_record_amax("fwd", 0, torch.tensor(2.0))
    m.fp8_record_amax("bwd", 1, torch.tensor(9.0))
    torch.testing.assert_close(
        m.fp8_fwd_amax_history[:, 0], torch.tensor([2.0, 1.0, 0.0]), atol=0, rtol=0
    )
    torch.testing.assert_close(
        m.fp8_bwd_amax_history[:, 1], torch.tensor([9.0, 0.0, 0.0]), atol=0, rtol=0
    )


def test_update_without_records_does_not_shift() -> None:
    m = Bare(1, history_rows=3)
    m.fp8_record_amax("fwd", 0, torch.tensor(4.0))
    m.fp8_update_scales("fwd")
    hist, scale = m.fp8_fwd_amax_history.clone(), m.fp8_fwd_scale.clone()
    m.fp8_update_scales("fwd")
    torch.testing.assert_close(m.fp8_fwd_amax_history, hist, atol=0, rtol=0)
    torch.testing.assert_close(m.fp8_fwd_scale, scale, atol=0, rtol=0)


def test_non_finite_amax_is_recorded_as_zero_and_keeps_scale() -> None:
    m = Bare(1, history_rows=2, recipe=DelayedScaling(amax_history_len=1))
    m.fp8_record_amax("fwd", 0, torch.tensor(float("inf")))
    m.fp8_record_amax("fwd", 1, torch.tensor(float("nan")))
    m.fp8_update_scales("fwd")
    assert not m.fp8_fwd_amax_history.any()
    torch.testing.assert_close(m.fp8_fwd_scale, torch.ones(3), atol=0, rtol=0)
    fresh = Bare(1, history_rows=2)
    fresh.set_extra_state(m.get_extra_state())  # the checkpoint stays valid


def test_load_starts_a_new_step() -> None:
    src = Bare(1, history_rows=3)
    src.fp8_record_amax("fwd", 0, torch.tensor(2.0))
    src.fp8_update_scales("fwd")
    m = Bare(1, history_rows=3)
    m.fp8_record_amax("fwd", 0, torch.tensor(100.0))  # mid-step before the load
    m.set_extra_state(src.get_extra_state())
    m.fp8_record_amax("fwd", 0, torch.tensor(3.0))
    torch.testing.assert_close(
        m.fp8_fwd_amax_history[:, 0], torch.tensor([3.0, 2.0, 0.0]), atol=0, rtol=0
    )


RECIPES = [
    DelayedScaling(amax_history_len=16),
    DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=4),
    DelayedScaling(margin=1, amax_history_len=16, amax_compute_algo="most_recent"),
    DelayedScaling(margin=5, fp8_format=Format.E4M3, amax_history_len=1),
]


def _recipe_id(r: DelayedScaling) -> str:
    return f"{r.fp8_format.name}-m{r.margin}-w{r.amax_history_len}-{r.amax_compute_algo}"


@pytest.mark.parametrize("recipe", RECIPES, ids=_recipe_id)
def test_scale_formula_holds_for_the_history_as_saved(recipe: DelayedScaling) -> None:
    m = TwoGemm(history_rows=16)
    gen = torch.Generator().manual_seed(0)
    for step in range(20):
        for d, n in (("fwd", 6), ("bwd", 4)):
            amax = torch.exp2(torch.rand(n, generator=gen) * 40 - 20)
            if step < 15:
                amax[step % n] = 0.0  # an unused slot now and then (outside the last window)
            for slot in range(n):
                m.fp8_record_amax(d, slot, amax[slot])
            m.fp8_update_scales(d, recipe)
    p = fields(save_load(m.state_dict())["_extra_state"])
    assert m.fp8_recipe == recipe
    window = int(p["recipe.amax_history_len"])
    for d in ("fwd", "bwd"):
        hist = p[f"{d}.amax_history"].numpy()
        amax = hist[0] if recipe.amax_compute_algo == "most_recent" else hist[:window].max(0)
        assert (amax > 0).all()
        fp8_max = np.float32(recipe.fp8_format.max(d))
        want = fp8_max / amax / np.float32(2.0**recipe.margin)
        torch.testing.assert_close(p[f"{d}.scale"], torch.from_numpy(want), atol=0, rtol=0)
        torch.testing.assert_close(
            p[f"{d}.scale_inv"], torch.from_numpy(np.float32(1) / want), atol=0, rtol=0
        )


def test_formats_use_their_direction_max() -> None:
    m = Bare(1, history_rows=1)
    for d in ("fwd", "bwd"):
        m.fp8_record_amax(d, 0, torch.tensor(1.0))
        m.fp8_update_scales(d)
    assert m.fp8_fwd_scale[0].item() == 448.0 and m.fp8_bwd_scale[0].item() == 57344.0


def test_recipe_window_longer_than_buffer_grows_with_one_warning() -> None:
    m = TwoGemm(history_rows=4)
    run_steps(m, 4)
    hist = {d: getattr(m, f"fp8_{d}_amax_history").clone() for d in ("fwd", "bwd")}
    long = DelayedScaling(amax_history_len=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.fp8_update_scales("fwd", long)
        m.fp8_update_scales("bwd", long)
    assert len(caught) == 1 and "4" in str(caught[0].message) and "10" in str(caught[0].message)
    for d in ("fwd", "bwd"):
        grown = getattr(m, f"fp8_{d}_amax_history")
        assert grown.shape[0] == 10
        torch.testing.assert_close(grown[:4], hist[d], atol=0, rtol=0)
        assert not grown[4:].any()
    fresh = TwoGemm(history_rows=10)
    fresh.load_state_dict(save_load(m.state_dict()))
    assert_state_equal(fresh, m)


def test_assigning_a_longer_recipe_grows_the_history_so_saves_stay_loadable() -> None:
    module = TwoGemm(history_rows=8)
    with pytest.warns(UserWarning, match="from 8 to 32 rows"):
        module.fp8_recipe = DelayedScaling(amax_history_len=32)
    assert module.fp8_meta("fwd").amax_history.shape[0] == 32
    fresh = TwoGemm(history_rows=8)
    with pytest.warns(UserWarning, match="32 rows, the module 8"):
        fresh.load_state_dict(module.state_dict())
    assert fresh.fp8_recipe == module.fp8_recipe


def test_assigning_a_non_recipe_is_refused() -> None:
    module = TwoGemm()
    with pytest.raises(FP8StateError, match="fp8_recipe"):
        module.fp8_recipe = "max"  # type: ignore[assignment]
