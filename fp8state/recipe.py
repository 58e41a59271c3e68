"""The delayed-scaling recipe: a frozen, validated dataclass stored in checkpoints as integers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fp8state.errors import RecipeError
from fp8state.formats import Format

__all__ = ["DelayedScaling", "AMAX_COMPUTE_ALGOS", "DEFAULT_HISTORY_ROWS"]

#: TE's default amax history length: the rows of a module's history buffers unless it asks for
#: others, and the default window of :class:`DelayedScaling`.
DEFAULT_HISTORY_ROWS = 1024

# Schema codes of ``amax_compute_algo`` (``recipe.amax_compute_algo``): never renumber.
AMAX_COMPUTE_ALGOS: tuple[str, ...] = ("max", "most_recent")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each step's scale comes from the amaxes of earlier steps.

    The recipe is plain data. A checkpoint stores it as four integers (see ``docs/schema.md``),
    never as a pickled object, so any fp8state version can read it back without running code.

    Args:
        margin: Scales are divided by ``2**margin`` to leave headroom; an integer >= 0.
        fp8_format: :class:`Format.HYBRID` (E4M3 forward, E5M2 gradients) or
            :class:`Format.E4M3`.
        amax_history_len: How many of the most recent steps the scale looks at. It is a window
            over the module's history buffer (1024 rows by default); a longer window grows the
            buffer once, with a warning.
        amax_compute_algo: ``"max"`` takes the largest amax in the window, ``"most_recent"`` the
            last step's.

    Raises:
        RecipeError: (a ``ValueError``) for a field out of range or of the wrong type.

    Example:
        >>> from fp8state import DelayedScaling, Format
        >>> recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=16)
        >>> DelayedScaling.from_scalars(recipe.to_scalars()) == recipe
        True
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = DEFAULT_HISTORY_ROWS
    amax_compute_algo: Literal["max", "most_recent"] = "max"

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise RecipeError(
                "DelayedScaling.margin", repr(self.margin), "an int >= 0", "Pass e.g. margin=0."
            )
        if not isinstance(self.fp8_format, Format):
            raise RecipeError(
                "DelayedScaling.fp8_format",
                repr(self.fp8_format),
                "fp8state.Format.E4M3 or fp8state.Format.HYBRID",
                "Pass a member of fp8state.Format.",
            )
        if (
            isinstance(self.amax_history_len, bool)
            or not isinstance(self.amax_history_len, int)
            or self.amax_history_len < 1
        ):
            raise RecipeError(
                "DelayedScaling.amax_history_len",
                repr(self.amax_history_len),
                "an int >= 1",
                "Pass e.g. amax_history_len=1024.",
            )
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise RecipeError(
                "DelayedScaling.amax_compute_algo",
                repr(self.amax_compute_algo),
                f"one of {AMAX_COMPUTE_ALGOS}",
                "Callables are not supported: they cannot be stored in a checkpoint.",
            )

    def to_scalars(self) -> dict[str, int]:
        """Return the recipe as the integers the schema stores (keys without ``recipe.``)."""
        return {
            "fp8_format": self.fp8_format.code,
            "margin": self.margin,
            "amax_history_len": self.amax_history_len,
            "amax_compute_algo": AMAX_COMPUTE_ALGOS.index(self.amax_compute_algo),
        }

    @classmethod
    def from_scalars(cls, scalars: dict[str, int]) -> DelayedScaling:
        """Build a recipe from :meth:`to_scalars` output.

        Raises:
            RecipeError: for an unknown format or algorithm code, or an invalid field.
        """
        fmt_code = int(scalars["fp8_format"])
        algo_code = int(scalars["amax_compute_algo"])
        try:
            fmt = Format.from_code(fmt_code)
        except KeyError:
            raise RecipeError(
                "recipe.fp8_format",
                str(fmt_code),
                "0 (E4M3) or 1 (HYBRID)",
                "The checkpoint was written by a newer fp8state or is corrupt.",
            ) from None
        if not 0 <= algo_code < len(AMAX_COMPUTE_ALGOS):
            raise RecipeError(
                "recipe.amax_compute_algo",
                str(algo_code),
                "0 (max) or 1 (most_recent)",
                "The checkpoint was written by a newer fp8state or is corrupt.",
            )
        return cls(
            margin=int(scalars["margin"]),
            fp8_format=fmt,
            amax_history_len=int(scalars["amax_history_len"]),
            amax_compute_algo=AMAX_COMPUTE_ALGOS[algo_code],  # type: ignore[arg-type]
        )
