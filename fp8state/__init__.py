"""fp8state: FP8 training for PyTorch with boringly correct checkpoints."""

import importlib
from typing import Any

from fp8state import errors
from fp8state._version import __version__
from fp8state.autocast import fp8_autocast, is_fp8_enabled
from fp8state.convert import convert_model, plan_conversion
from fp8state.export import export_fp8
from fp8state.formats import Format
from fp8state.functional import activation_checkpoint
from fp8state.graphs import make_graphed_callables
from fp8state.integrations.forward import autocast_forward
from fp8state.mixin import FP8StateMixin
from fp8state.modules import Conv1D, LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from fp8state.recalibration import CalibrationReport, recalibrate
from fp8state.recipe import DelayedScaling
from fp8state.tuning import FallbackTuning, tune_fallback
from fp8state.weights_ahead import cast_weights_ahead

__all__ = [
    "__version__",
    "errors",
    "Format",
    "DelayedScaling",
    "FP8StateMixin",
    "Linear",
    "LayerNorm",
    "RMSNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Conv1D",
    "fp8_autocast",
    "is_fp8_enabled",
    "autocast_forward",
    "activation_checkpoint",
    "make_graphed_callables",
    "cast_weights_ahead",
    "export_fp8",
    "convert_model",
    "plan_conversion",
    "recalibrate",
    "CalibrationReport",
    "tune_fallback",
    "FallbackTuning",
    "migrate",
    "checkpoint",
]

# Sub-packages with heavier imports load on first attribute access (`fp8state.migrate`).
_LAZY_SUBMODULES = ("migrate", "checkpoint")


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"fp8state.{name}")
    raise AttributeError(f"module 'fp8state' has no attribute {name!r}")
