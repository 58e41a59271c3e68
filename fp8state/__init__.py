"""fp8state: FP8 training for PyTorch with boringly correct checkpoints."""

from fp8state import errors
from fp8state._version import __version__
from fp8state.formats import Format
from fp8state.mixin import FP8StateMixin
from fp8state.recipe import DelayedScaling

__all__ = [
    "__version__",
    "errors",
    "Format",
    "DelayedScaling",
    "FP8StateMixin",
]
