"""Errors fp8state raises on purpose.

Every error names the place it concerns (a state-dict key, a payload key or a module), what was
found, what was expected and what to do about it. All of them subclass :class:`FP8StateError`, so
``except fp8state.errors.FP8StateError`` catches everything the library raises deliberately.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "FP8StateError",
    "RecipeError",
    "SchemaError",
    "SchemaVersionError",
    "LegacyFormatError",
    "UnsafeCheckpointError",
    "CheckpointError",
    "StateDictError",
    "DistributedStateError",
    "ConversionError",
    "ConfigError",
    "RecomputationError",
    "ExportError",
]


class FP8StateError(Exception):
    """Base class of every error fp8state raises on purpose.

    Args:
        key: What the error is about: a state-dict key (``"blocks.0.fc1._extra_state"``), a key
            inside an extra-state payload (``"fwd.scale"``), a module name or an argument.
        found: What was found there.
        expected: What should have been there.
        fix: What the user can do about it.

    Example:
        >>> import fp8state
        >>> from fp8state.errors import FP8StateError
        >>> try:
        ...     fp8state.DelayedScaling(margin=-1)
        ... except FP8StateError as err:
        ...     caught = err
        >>> type(caught).__name__, caught.key, caught.found, caught.expected
        ('RecipeError', 'DelayedScaling.margin', '-1', 'an int >= 0')
        >>> print(caught)
        DelayedScaling.margin: found -1; expected an int >= 0. Pass e.g. margin=0.
    """

    def __init__(self, key: str, found: str, expected: str, fix: str) -> None:
        self.key = key
        self.found = found
        self.expected = expected
        self.fix = fix
        super().__init__(f"{key}: found {found}; expected {expected}. {fix}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through ``args`` by default; ours take four keyword-ish fields, so
        # spell them out (multiprocessing and torch.distributed pickle exceptions across ranks).
        return (type(self), (self.key, self.found, self.expected, self.fix))

    def under(self, prefix: str) -> FP8StateError:
        """Return the same error with ``prefix`` put in front of its key.

        Used to name the state-dict key when the error is raised inside ``load_state_dict``.

        Example:
            >>> from fp8state.errors import SchemaError
            >>> err = SchemaError("['fwd.scale']", "nan", "finite values > 0", "Load another.")
            >>> err.under("blocks.1._extra_state").key
            "blocks.1._extra_state['fwd.scale']"
        """
        return type(self)(f"{prefix}{self.key}", self.found, self.expected, self.fix)


class RecipeError(FP8StateError, ValueError):
    """A recipe (:class:`fp8state.DelayedScaling`) was given an invalid field."""


class SchemaError(FP8StateError, ValueError):
    """An extra-state payload does not follow the schema (keys, dtypes, shapes or values)."""


class SchemaVersionError(SchemaError):
    """An extra-state payload has a schema version this library cannot read.

    Example:
        >>> import torch
        >>> from fp8state.errors import SchemaVersionError
        >>> from fp8state.schema import default_payload, unpack
        >>> payload = default_payload(num_gemms=1)
        >>> payload[0] = 3.0  # the header's version, as a newer fp8state would write it
        >>> try:
        ...     unpack(payload)
        ... except SchemaVersionError as err:
        ...     print(err.found, "|", err.fix)
        version 3 | Upgrade fp8state to read this checkpoint.
    """


class LegacyFormatError(FP8StateError, ValueError):
    """A TransformerEngine checkpoint or extra state could not be decoded."""


class UnsafeCheckpointError(FP8StateError):
    """A pickle asked for a Python global outside the allow-list; nothing was executed."""


class CheckpointError(FP8StateError):
    """A checkpoint file or state dict could not be read or does not fit the model."""


class StateDictError(CheckpointError):
    """A state dict does not fit a model; nothing was loaded.

    Its message lists the problems one per line, then says what was expected and what to do
    on a line of its own.

    Attributes:
        problems: One :class:`~fp8state.errors.FP8StateError` per key at fault, each naming
            the key, what was found, what was expected and the fix.
    """

    def __init__(
        self,
        key: str,
        found: str,
        expected: str,
        fix: str,
        problems: Sequence[FP8StateError] = (),
    ) -> None:
        super().__init__(key, found, expected, fix)
        self.problems = tuple(problems)
        # The list ends with a problem's own sentence; the summary gets a line of its own.
        self.args = (f"{key}: found {found}\nExpected {expected}. {fix}",)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.found, self.expected, self.fix, self.problems))


class DistributedStateError(FP8StateError):
    """FP8 metadata that must agree across ranks does not."""


class ConversionError(FP8StateError, ValueError):
    """A module cannot be converted to its fp8state counterpart."""


class ConfigError(FP8StateError, ValueError):
    """A module or function was given arguments it cannot work with."""


class ExportError(FP8StateError, ValueError):
    """A model or checkpoint cannot be exported as an FP8 inference checkpoint as asked.

    Raised before anything is written: a module that never ran in FP8, a scale that is not
    finite and positive, a shape FP8 GEMMs cannot take, an existing output folder.

    Example:
        >>> import tempfile, torch, fp8state
        >>> model = torch.nn.Sequential(fp8state.Linear(16, 16))  # never run in FP8
        >>> try:
        ...     fp8state.export_fp8(model, tempfile.mkdtemp() + "/out")
        ... except fp8state.errors.ExportError as err:
        ...     print(err.key, "|", err.expected)
        0 | a module that ran forward passes under fp8_autocast
    """


class RecomputationError(FP8StateError, RuntimeError):
    """An activation recomputation cannot replay its forward's FP8 state exactly.

    Raised before the call computes anything, instead of computing other numbers.

    ``torch.utils.checkpoint`` runs a checkpointed function again during backward. fp8state
    replays each FP8 GEMM of that run with the scales and settings of its forward; where it
    cannot tell which forward a recomputation belongs to (several forwards of the module with
    different scales wait for one backward), or kept no record of it, it raises this.
    ``fp8state.functional.activation_checkpoint`` replays every case exactly
    (``docs/activation_checkpointing.md``).

    Example:
        >>> from fp8state.errors import FP8StateError, RecomputationError
        >>> err = RecomputationError("Linear (GEMM 0)", "2 forwards", "one", "Use the drop-in.")
        >>> isinstance(err, FP8StateError), err.key
        (True, 'Linear (GEMM 0)')
    """
