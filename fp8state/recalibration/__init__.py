"""Fill amax histories and scales from a few batches, without training (:func:`recalibrate`).

The package is ``fp8state.recalibration``; the function is ``fp8state.recalibrate``.
"""

from fp8state.recalibration._recalibrate import CalibrationReport, recalibrate

__all__ = ["recalibrate", "CalibrationReport"]
