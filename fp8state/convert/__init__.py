"""Swap a model's ``torch.nn`` layers for fp8state modules in place, keeping every Parameter.

:func:`convert_model` does it, :func:`plan_conversion` says what it would do; both return a
:class:`ConversionReport`. The rules (exact types only, and why) are in ``_rules``, the new
modules are built in ``_build``; ``docs/interop.md`` is the user's guide.
"""

from fp8state.convert._build import FUSED_FROM_ATTR, FusedFrom
from fp8state.convert._report import ConversionReport, ModuleDecision, PairDecision
from fp8state.convert._swap import convert_model, plan_conversion

__all__ = [
    "convert_model",
    "plan_conversion",
    "ConversionReport",
    "ModuleDecision",
    "PairDecision",
    "FusedFrom",
    "FUSED_FROM_ATTR",
]
