"""Choose where eager FP8 GEMMs fall back to high precision by timing the step.

The package is ``fp8state.tuning``; the function is also ``fp8state.tune_fallback``.
"""

from fp8state.tuning._tune import FallbackTuning, tune_fallback

__all__ = ["tune_fallback", "FallbackTuning"]
