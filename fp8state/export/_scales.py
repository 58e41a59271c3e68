"""The scales of an exported FP8 layer: the weight's from the weight, the input's from history.

compressed-tensors stores each scale as the dequantization multiplier (a real value is the
FP8 value times the scale): fp8state's ``scale_inv``, ``1 / scale``. Both are float32 of
shape ``(1,)``, the shape compressed-tensors gives per-tensor scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8state import quantize, scaling
from fp8state.errors import ConfigError, ExportError
from fp8state.recipe import DelayedScaling

__all__ = ["InputScaleRule", "quantize_weight", "input_scale_inv"]


@dataclass(frozen=True)
class InputScaleRule:
    """How the input scale is taken from a module's forward input amax history.

    Attributes:
        window: Most recent steps to consider; None takes the recipe's ``amax_history_len``.
        percentile: None applies the recipe's ``amax_compute_algo`` (``max`` or
            ``most_recent``) as training does; a number in (0, 100] takes that percentile
            of the recorded (non-zero) amaxes in the window instead.
    """

    window: int | None = None
    percentile: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (type(self.window) is not int or self.window < 1):
            raise ConfigError(
                "window", repr(self.window), "an int >= 1, or None", "Pass a number of steps."
            )
        if self.percentile is not None and not (
            isinstance(self.percentile, (int, float))
            and not isinstance(self.percentile, bool)
            and 0 < self.percentile <= 100
        ):
            raise ConfigError(
                "percentile",
                repr(self.percentile),
                "a number in (0, 100], or None",
                "Pass e.g. 99.9, or None for the recipe's own rule.",
            )


def _checked(scale: torch.Tensor, module: str, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ExportError(
            module,
            f"a {what} scale of {scale.item()!r}",
            "a finite scale > 0",
            "Recalibrate the module (fp8state.recalibration) or leave it out of the export.",
        )
    return scale


def quantize_weight(
    weight: torch.Tensor, recipe: DelayedScaling, module: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight in FP8, its scale_inv)``, the scale from the weight's own amax.

    The amax becomes a scale as the recipe makes one (``fp8_max / amax / 2**margin``); the
    weight is cast to the recipe's forward FP8 dtype, saturating.

    Raises:
        ExportError: the weight holds a non-finite value.
    """
    values = weight.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(values).all()):
        raise ExportError(
            module,
            "a weight holding inf or NaN",
            "finite weights",
            "Fix the training run (the weights diverged) before exporting.",
        )
    fmt = recipe.fp8_format
    amax = quantize.finite_amax(values).reshape(1)
    # An all-zero weight keeps scale 1 (the recipe keeps its previous scale for amax 0).
    scale = scaling.scale_from_amax(amax, torch.ones(1), fmt.max("fwd"), recipe.margin)
    scale = _checked(scale, module, "weight")
    return quantize.quantize(values, scale, fmt.dtype("fwd")), torch.reciprocal(scale)


def input_scale_inv(
    history: torch.Tensor,
    stored_scale: torch.Tensor,
    recipe: DelayedScaling,
    rule: InputScaleRule,
    module: str,
) -> torch.Tensor:
    """The input's ``scale_inv`` from its amax history column, as the recipe computes it.

    Args:
        history: ``(rows,)`` float32, row 0 the most recent step.
        stored_scale: ``(1,)`` the slot's current scale, kept where the amax is 0 (as training
            keeps it).
        recipe: The module's recipe (margin, window, algorithm, format).
        rule: Another window or a percentile, if any.
        module: Named in errors.

    Raises:
        ExportError: nothing recorded in the window (the module never ran in FP8), or a
            scale that is not finite and > 0.
    """
    window = rule.window or recipe.amax_history_len
    recorded = history.detach().to("cpu", torch.float32)[:window]
    seen = recorded[(recorded > 0) & torch.isfinite(recorded)]
    if seen.numel() == 0:
        raise ExportError(
            module,
            f"an empty forward input amax history (nothing recorded in the last {window} steps)",
            "a module that ran forward passes under fp8_autocast",
            "Run training or calibration steps in FP8 before exporting, or leave it out (a "
            "GEMM smaller than the module's fp8_min_gemm_macs runs in high precision and "
            "records nothing).",
        )
    if rule.percentile is None:
        amax = scaling.amax_from_history(recorded[:, None], window, recipe.amax_compute_algo)
    else:
        amax = torch.quantile(seen.to(torch.float64), rule.percentile / 100).to(torch.float32)
        amax = amax.reshape(1)
    prev = stored_scale.detach().to("cpu", torch.float32).reshape(1)
    scale = scaling.scale_from_amax(amax, prev, recipe.fp8_format.max("fwd"), recipe.margin)
    return torch.reciprocal(_checked(scale, module, "forward input"))
