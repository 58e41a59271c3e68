"""``recalibrate``: fill amax histories and scales from a few batches, without training.

After loading weights trained elsewhere (a high-precision checkpoint, or one whose FP8 metadata
belongs to other weights) or after changing the recipe, the delayed scales describe tensors the
model no longer computes. TE users fix that by hand with ``fp8_autocast(calibrating=True)``;
:func:`recalibrate` does it in one call, and changes nothing but the FP8 metadata.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fp8state import autocast
from fp8state._runtime import snapshot
from fp8state.errors import ConfigError
from fp8state.mixin import FP8StateMixin
from fp8state.recalibration._batches import forward_batch
from fp8state.recalibration._saved import (
    Saved,
    restore,
    save,
    with_fwd,
)
from fp8state.recalibration._saved import reset as reset_directions
from fp8state.recipe import DelayedScaling
from fp8state.schema import DIRECTIONS

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["recalibrate", "CalibrationReport"]

_WHERE = "recalibrate"
_SKIPPED_NAMES_SHOWN = 10
_NO_BATCH = object()


@dataclass(frozen=True)
class CalibrationReport:
    """What :func:`recalibrate` did.

    Attributes:
        batches: Batches run (each once forward-only, and once more with backward when a
            ``loss_fn`` was given).
        modules: Names (as in ``model.named_modules()``) of the FP8 modules calibrated.
        skipped: FP8 modules that did not run on any batch; their metadata is unchanged.
        backward: True when backward scales were measured too (``loss_fn`` given).
        recipe: The recipe the calibrated modules now carry.
    """

    batches: int
    modules: tuple[str, ...]
    skipped: tuple[str, ...]
    backward: bool
    recipe: DelayedScaling


def _resolve_recipe(
    recipe: DelayedScaling | None, modules: dict[str, FP8StateMixin]
) -> DelayedScaling:
    if recipe is not None:
        if not isinstance(recipe, DelayedScaling):
            raise ConfigError(
                f"{_WHERE}(fp8_recipe=...)",
                type(recipe).__name__,
                "an fp8state.DelayedScaling",
                "Build the recipe with fp8state.DelayedScaling.",
            )
        return recipe
    found = {m.fp8_recipe for m in modules.values()}
    if len(found) > 1:
        raise ConfigError(
            f"{_WHERE}(fp8_recipe=None)",
            f"FP8 modules with {len(found)} different recipes",
            "one recipe shared by every FP8 module, or fp8_recipe given",
            "Pass fp8_recipe=fp8state.DelayedScaling(...): the recipe training will use.",
        )
    return found.pop()


def _check_arguments(
    model: Any, batches: Any, num_batches: int | None, forward_fn: Any, loss_fn: Any
) -> dict[str, FP8StateMixin]:
    """Every check that needs no batch; returns the model's FP8 modules by name."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{_WHERE}(model=...)",
            type(model).__name__,
            "a torch.nn.Module",
            "Pass the model whose FP8 modules should be calibrated.",
        )
    modules = {
        name: m for name, m in _unwrap(model).named_modules() if isinstance(m, FP8StateMixin)
    }
    if not modules:
        raise ConfigError(
            f"{_WHERE}(model={type(model).__name__})",
            f"no FP8 module among its {len(list(model.modules()))} modules",
            "at least one fp8state module (Linear, LayerNormLinear, LayerNormMLP or an "
            "FP8StateMixin subclass)",
            "Build the model from fp8state modules or convert it with "
            "fp8state.convert_model(model); plain torch.nn layers hold no FP8 scales. "
            "fp8state.plan_conversion(model) shows why a layer stays in high precision.",
        )
    if isinstance(batches, (torch.Tensor, str, bytes)) or not isinstance(batches, Iterable):
        raise ConfigError(
            f"{_WHERE}(batches=...)",
            type(batches).__name__,
            "an iterable of batches (a list, a DataLoader, a generator)",
            "Wrap a single batch in a list: recalibrate(model, [x]).",
        )
    if num_batches is not None and (
        isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1
    ):
        raise ConfigError(
            f"{_WHERE}(num_batches=...)",
            repr(num_batches),
            "None or an int >= 1",
            "Pass how many batches to take, e.g. num_batches=8.",
        )
    for name, fn in (("forward_fn", forward_fn), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise ConfigError(
                f"{_WHERE}({name}=...)",
                type(fn).__name__,
                "a callable or None",
                f"Pass a function as {name}.",
            )
    if autocast._THREAD.stack:
        # Inside an outer context the scales would only update when *it* exits, after
        # recalibrate returned: the calibration would silently not have happened yet.
        raise ConfigError(
            _WHERE,
            "a call inside fp8_autocast",
            "a call outside any fp8_autocast context",
            "Call recalibrate before entering fp8_autocast (it opens its own contexts).",
        )
    return modules


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (amaxes are reduced over ``fp8_group`` anyway).

    DDP's own forward would broadcast buffers and wait for a backward that
    ``torch.autograd.grad`` never gives its gradient hooks.
    """
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _backward_pass(
    run: nn.Module,
    batch: Any,
    forward_fn: Any,
    loss_fn: Any,
    params: list[torch.nn.Parameter],
    recipe: DelayedScaling,
    group: Any,
) -> None:
    """One FP8 forward and backward; gradients are computed and dropped, ``.grad`` untouched."""
    with torch.enable_grad():
        with autocast.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group):
            out = forward_batch(run, batch, forward_fn)
        loss = loss_fn(out, batch)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            found = (
                f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise ConfigError(
                f"{_WHERE}(loss_fn=...)",
                found,
                "a one-element tensor that requires grad (the loss of the model's output)",
                "Return the loss computed from the output, e.g. F.mse_loss(out, batch[1]).",
            )
        # autograd.grad, not backward(): nothing accumulates into .grad and no gradient hook
        # (DDP's all-reduce, an optimizer step in backward) fires.
        torch.autograd.grad(loss, params, allow_unused=True)


def recalibrate(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    fp8_recipe: DelayedScaling | None = None,
    fp8_group: ProcessGroup | None = None,
    forward_fn: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    num_batches: int | None = None,
    reset: bool = True,
    training: bool | None = None,
) -> CalibrationReport:
    """Measure amaxes on ``batches`` and set every FP8 module's scales from them.

    Forward: the batches run under ``torch.no_grad`` and ``fp8_autocast(calibrating=True)``
    (high-precision compute, amaxes recorded), all in **one** step: each calibrated module gets
    one new history row holding the max over all batches (and all ranks of ``fp8_group``).
    With ``reset`` (the default) the rest of the history is zero, so every input and weight
    slot ends with ``scale = fp8_max / amax / 2**margin`` of that max, whatever the recipe's
    window and algorithm. Slots nothing records into (the built-in modules' output slots)
    keep their scale: 1 after a reset.

    Backward: gradients cannot be seen without a backward pass. Without ``loss_fn`` the
    backward histories are kept (they still describe the gradients' magnitudes best) and the
    backward scales are recomputed from them under the recipe, so a checkpoint is consistent
    with its recipe. With ``loss_fn`` every batch also runs forward (FP8, with the calibrated
    forward scales) and backward; the gradient amaxes go into one new backward row (max over
    the batches) and set the backward scales. Gradients are computed with
    ``torch.autograd.grad`` and dropped: parameters' ``.grad`` and gradient hooks are untouched.

    Only FP8 metadata changes. Afterwards the model's train/eval flags, its other buffers (e.g.
    BatchNorm statistics a training-mode forward would update) and the random number
    generators are as they were. If anything raises, the FP8 metadata is restored too.

    Args:
        model: A model holding fp8state modules (a ``DistributedDataParallel`` wrapper is
            looked through).
        batches: Iterable of inputs: a tensor is passed as ``model(x)``, a tuple or list as
            ``model(*b)``, a dict as ``model(**b)``; anything else needs ``forward_fn``, and
            so do ``(input, target)`` pairs, as a ``DataLoader`` over a
            ``TensorDataset(x, y)`` yields. With ``loss_fn`` the batches are kept in memory to
            run twice.
        fp8_recipe: The recipe to calibrate for (the one training will use); it becomes each
            calibrated module's ``fp8_recipe``. Default: the recipe the modules already carry
            (they must agree).
        fp8_group: Process group over which amaxes are reduced, as in ``fp8_autocast``
            (None: the default group when ``torch.distributed`` is initialized). Every rank
            must call ``recalibrate`` with the same number of batches.
        forward_fn: ``forward_fn(model, batch) -> output``, for batches that are not plain
            model arguments (e.g. ``(input, target)`` pairs).
        loss_fn: ``loss_fn(output, batch) -> scalar tensor``; also calibrates backward scales.
        num_batches: Take only the first ``num_batches`` batches (for a DataLoader).
        reset: Clear the histories (and set scales to 1) of the calibrated direction(s) first,
            so amaxes of other weights or an older recipe's window do not linger. False keeps
            them: the new row joins the recipe's window like a training step's.
        training: Run the batches in training mode (True), eval mode (False) or each
            submodule's current mode (None).

    Returns:
        A :class:`CalibrationReport`.

    Raises:
        ConfigError: no FP8 module in ``model``; no batch; a batch the model cannot take
            without ``forward_fn`` (also a tuple, list or dict batch the model raised
            ``TypeError`` for, chained to it); ``loss_fn`` returned no differentiable scalar;
            called inside ``fp8_autocast``; modules with different recipes and no
            ``fp8_recipe``. The model is unchanged.

    Example:
        >>> import torch, fp8state
        >>> layer = fp8state.Linear(16, 8)
        >>> batches = [torch.randn(4, 16) for _ in range(3)]
        >>> report = fp8state.recalibrate(layer, batches)
        >>> amax = max(float(b.abs().max()) for b in batches)
        >>> torch.equal(layer.fp8_meta("fwd").scale[0], torch.tensor(448.0) / amax)
        True
        >>> report.batches, report.modules
        (3, ('',))
    """
    modules = _check_arguments(model, batches, num_batches, forward_fn, loss_fn)
    recipe = _resolve_recipe(fp8_recipe, modules)
    iterator: Iterator[Any] = iter(batches)
    if num_batches is not None:
        iterator = itertools.islice(iterator, num_batches)
    first = next(iterator, _NO_BATCH)
    if first is _NO_BATCH:
        raise ConfigError(
            f"{_WHERE}(batches=...)",
            "no batch",
            "at least one batch",
            "Pass a few batches of representative inputs; nothing was changed.",
        )
    run = _unwrap(model)
    params = [p for p in run.parameters() if p.requires_grad]
    if loss_fn is not None and not params:
        raise ConfigError(
            f"{_WHERE}(loss_fn=...)",
            "no parameter that requires grad",
            "a model with trainable parameters",
            "Drop loss_fn: a frozen model has no gradients to calibrate for.",
        )
    for m in modules.values():
        m._fp8_ensure_rows(recipe.amax_history_len)  # a longer window grows once, up front
    saved = {name: save(m) for name, m in modules.items()}
    modes = [(m, m.training) for m in run.modules()]
    cuda = sorted(
        {
            t.device.index or 0
            for t in itertools.chain(run.parameters(), run.buffers())
            if t.device.type == "cuda"
        }
    )
    buffers: list[snapshot.SavedBuffer] = []
    try:
        if training is not None:
            run.train(training)
        buffers = snapshot.take_buffers(run, modules.values())
        with torch.random.fork_rng(devices=cuda):  # dropout draws must not shift training's
            report = _calibrate(
                run,
                modules,
                itertools.chain([first], iterator),
                recipe,
                fp8_group,
                forward_fn,
                loss_fn,
                params,
                reset,
                saved,
            )
    except BaseException:
        for name, fp8_module in modules.items():
            restore(fp8_module, saved[name])
        raise
    finally:
        snapshot.put_back_buffers(buffers)
        for module, flag in modes:
            module.training = flag
    if report.skipped:
        shown = ", ".join(report.skipped[:_SKIPPED_NAMES_SHOWN])
        more = len(report.skipped) - _SKIPPED_NAMES_SHOWN
        warnings.warn(
            f"recalibrate: {len(report.skipped)} FP8 module(s) did not run on any batch and "
            f"keep their metadata: {shown}{f' and {more} more' if more > 0 else ''}",
            stacklevel=2,
        )
    return report


def _calibrate(
    run: nn.Module,
    modules: dict[str, FP8StateMixin],
    batches: Iterator[Any],
    recipe: DelayedScaling,
    group: Any,
    forward_fn: Any,
    loss_fn: Any,
    params: list[torch.nn.Parameter],
    reset: bool,
    saved: dict[str, Saved],
) -> CalibrationReport:
    """The calibration itself; :func:`recalibrate` checks arguments and restores on error."""
    if reset:
        directions = DIRECTIONS if loss_fn is not None else ("fwd",)
        for m in modules.values():
            reset_directions(m, directions)
    before = {name: m._fp8_mutation_count() for name, m in modules.items()}
    kept: list[Any] = []
    count = 0
    # One context for all batches: one step, one amax reduction, one scale update at its exit.
    with (
        torch.no_grad(),
        autocast.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe, fp8_group=group),
    ):
        for batch in batches:
            forward_batch(run, batch, forward_fn)
            count += 1
            if loss_fn is not None:
                kept.append(batch)
    # A module that recorded an amax bumped its mutation counter; the others did not run.
    ran = {n: m for n, m in modules.items() if m._fp8_mutation_count() != before[n]}
    for name in modules.keys() - ran.keys():
        restore(modules[name], saved[name])
    if loss_fn is not None and ran:
        calibrated_fwd = {n: save(m).state.fwd for n, m in ran.items()}
        for m in ran.values():
            m.fp8_amax_cell("bwd", 0)  # opens the one backward row every pass records into
        for i, batch in enumerate(kept):
            _backward_pass(run, batch, forward_fn, loss_fn, params, recipe, group)
            for name, m in ran.items():
                # The FP8 forward just updated forward scales from its own amaxes: put the
                # calibrated ones back, so every pass (and the result) uses those.
                with_fwd(m, calibrated_fwd[name])
                if i < len(kept) - 1:
                    m._fp8_continue_step("bwd")  # the next pass max-combines into the row
    for m in ran.values():
        # Backward scales from the backward history under this recipe (its format's maximum,
        # margin and window), so the saved scales match the saved recipe.
        m.fp8_update_scales("bwd", recipe)
    names = tuple(n for n in modules if n in ran)
    skipped = tuple(n for n in modules if n not in ran)
    return CalibrationReport(
        batches=count, modules=names, skipped=skipped, backward=loss_fn is not None, recipe=recipe
    )
