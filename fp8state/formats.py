"""FP8 formats: which FP8 dtype and maximum each direction of a GEMM uses.

Nothing here touches CUDA: the dtypes are plain ``torch.dtype`` objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from fp8state.slots import Direction, by_direction

__all__ = ["Format", "FormatSpec"]


@dataclass(frozen=True)
class FormatSpec:
    """The numerics of one :class:`Format` value.

    Attributes:
        fwd_dtype: FP8 dtype of forward tensors (inputs, weights).
        fwd_max: Largest finite value of ``fwd_dtype``.
        bwd_dtype: FP8 dtype of backward tensors (gradients).
        bwd_max: Largest finite value of ``bwd_dtype``.

    Example:
        >>> from fp8state import Format
        >>> spec = Format.E4M3.spec
        >>> spec.fwd_dtype == spec.bwd_dtype, spec.bwd_max
        (True, 448.0)
    """

    fwd_dtype: torch.dtype
    fwd_max: float
    bwd_dtype: torch.dtype
    bwd_max: float


_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # 57344


class Format(enum.Enum):
    """FP8 format of a recipe, as in TransformerEngine.

    ``E4M3`` uses E4M3 (max 448) in both directions; ``HYBRID`` uses E4M3 forward and E5M2
    (max 57344) for gradients, which need range more than precision.

    The schema code (``recipe.fp8_format`` in a checkpoint) is :attr:`code`.

    Example:
        >>> from fp8state import Format
        >>> Format.HYBRID.dtype("fwd"), Format.HYBRID.dtype("bwd")
        (torch.float8_e4m3fn, torch.float8_e5m2)
        >>> Format.HYBRID.max("fwd"), Format.HYBRID.max("bwd")
        (448.0, 57344.0)
        >>> Format.HYBRID.code, Format.from_code(0)
        (1, <Format.E4M3: ...>)
    """

    E4M3 = FormatSpec(torch.float8_e4m3fn, _E4M3_MAX, torch.float8_e4m3fn, _E4M3_MAX)
    HYBRID = FormatSpec(torch.float8_e4m3fn, _E4M3_MAX, torch.float8_e5m2, _E5M2_MAX)

    @property
    def spec(self) -> FormatSpec:
        """The dtypes and maxima of this format."""
        return self.value  # type: ignore[no-any-return]

    @property
    def code(self) -> int:
        """The integer stored as ``recipe.fp8_format`` in schema payloads."""
        return _CODES[self]

    @classmethod
    def from_code(cls, code: int) -> Format:
        """Return the format stored as ``code``; raises ``KeyError`` for unknown codes."""
        return _FORMATS_BY_CODE[code]

    def dtype(self, direction: Direction) -> torch.dtype:
        """FP8 dtype for ``direction`` (``"fwd"`` or ``"bwd"``)."""
        return by_direction(direction, self.spec.fwd_dtype, self.spec.bwd_dtype)

    def max(self, direction: Direction) -> float:
        """Largest finite FP8 value for ``direction`` (``"fwd"`` or ``"bwd"``)."""
        return by_direction(direction, self.spec.fwd_max, self.spec.bwd_max)


# Codes are part of the checkpoint schema: never renumber, only append.
_CODES = {Format.E4M3: 0, Format.HYBRID: 1}
_FORMATS_BY_CODE = {code: fmt for fmt, code in _CODES.items()}
