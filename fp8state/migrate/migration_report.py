"""What a checkpoint conversion did, entry by entry, as text (``fp8state migrate``) or JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8state.recipe import DelayedScaling

__all__ = [
    "EntryReport",
    "MigrationReport",
    "CONVERTED",
    "KEPT",
    "DEFAULTED",
    "DROPPED",
    "FAILED",
    "recipe_dict",
]

#: TE FP8 state converted to the schema.
CONVERTED = "converted"
#: Already an fp8state payload; validated and kept as it is.
KEPT = "kept"
#: No FP8 state in the file; a fresh schema state was written (GEMM count known).
DEFAULTED = "default"
#: No FP8 state and no GEMM count (norms, attention with FP8 off): the key was removed.
DROPPED = "dropped"
#: Undecodable or unsafe (``strict=False`` only): the key was removed.
FAILED = "failed"


def recipe_dict(recipe: DelayedScaling | None) -> dict[str, Any] | None:
    """A recipe as plain JSON values (``fp8_format`` by name)."""
    if recipe is None:
        return None
    return {
        "fp8_format": recipe.fp8_format.name,
        "margin": recipe.margin,
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": recipe.amax_compute_algo,
    }


@dataclass
class EntryReport:
    """The fate of one ``_extra_state`` entry.

    Attributes:
        key: The state-dict key, under ``"<container>/"`` when the state dict sat under
            ``"model"``, ``"state_dict"`` or ``"module"``.
        action: One of :data:`CONVERTED`, :data:`KEPT`, :data:`DEFAULTED`, :data:`DROPPED`,
            :data:`FAILED`.
        era: The TE era (``"E05"``), ``"fp8state schema v1"``, or the eras an FP8-off form
            comes from.
        container: How the value was stored.
        num_gemms, rows, recipe, recipe_source, defaulted: As in
            :class:`~fp8state._te.extra_state.DecodedExtraState`.
        notes: Remarks (why there is no state, what TE-only data was dropped).
        error: The error message of a :data:`FAILED` entry.
        locations: Location tags the module's tensors were saved with (``"cuda:0"``).
        te_slots: TE's ``(forward, backward)`` FP8 tensor counts, for converted entries.
        payload: The resulting payload (not serialised into JSON).
    """

    key: str
    action: str
    era: str = ""
    container: str = ""
    num_gemms: int | None = None
    rows: int | None = None
    recipe: DelayedScaling | None = None
    recipe_source: str = ""
    defaulted: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    error: str | None = None
    locations: tuple[str, ...] = ()
    te_slots: tuple[int, int] | None = None
    payload: torch.Tensor | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (no tensors)."""
        return {
            "key": self.key,
            "action": self.action,
            "era": self.era,
            "container": self.container,
            "num_gemms": self.num_gemms,
            "rows": self.rows,
            "recipe": recipe_dict(self.recipe),
            "recipe_source": self.recipe_source,
            "defaulted_recipe_fields": list(self.defaulted),
            "notes": list(self.notes),
            "error": self.error,
            "saved_locations": list(self.locations),
            "te_slots": None if self.te_slots is None else list(self.te_slots),
        }

    def line(self) -> str:
        """One line of the text report."""
        parts = [f"{self.action:<9} {self.key}"]
        if self.era:
            parts.append(f"[{self.era}, {self.container}]" if self.container else f"[{self.era}]")
        if self.num_gemms is not None:
            parts.append(f"{self.num_gemms} GEMM(s), {self.rows} history rows")
        if self.defaulted:
            parts.append(f"defaulted recipe fields: {', '.join(self.defaulted)}")
        parts.extend(self.notes)
        if self.error:
            parts.append(self.error)
        return " | ".join(parts)


@dataclass
class MigrationReport:
    """The conversion report of one checkpoint (or state dict).

    Attributes:
        source: The file (or ``"<state dict>"``).
        strict: Whether bad entries were fatal.
        state_dicts: Where state dicts were found (``""`` = the top level, or ``"model"`` ...).
        entries: One report per ``_extra_state`` key, in file order.
        other_tensors: Tensors left bit-identical (parameters, buffers, other entries).
    """

    source: str
    strict: bool = True
    state_dicts: list[str] = field(default_factory=list)
    entries: list[EntryReport] = field(default_factory=list)
    other_tensors: int = 0

    def counts(self) -> dict[str, int]:
        """Number of entries per action."""
        return dict(Counter(e.action for e in self.entries))

    def failed(self) -> list[EntryReport]:
        """Entries dropped because they could not be decoded (``strict=False``)."""
        return [e for e in self.entries if e.action == FAILED]

    def summary(self) -> str:
        """One line: counts per action and the number of untouched tensors."""
        counts = self.counts()
        actions = (CONVERTED, KEPT, DEFAULTED, DROPPED, FAILED)
        done = ", ".join(f"{counts[a]} {a}" for a in actions if counts.get(a))
        return (
            f"{self.source}: {len(self.entries)} extra states ({done or 'none'}); "
            f"{self.other_tensors} other tensors unchanged"
        )

    def format_text(self) -> str:
        """The report as text: one line per entry, then the summary."""
        return "\n".join(self.text_lines())

    def text_lines(self) -> list[str]:
        """:meth:`format_text`'s lines, one string each (a key may hold a newline itself)."""
        where = ", ".join(repr(s) if s else "top level" for s in self.state_dicts)
        return [f"state dicts: {where}"] + [e.line() for e in self.entries] + [self.summary()]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "source": self.source,
            "strict": self.strict,
            "state_dicts": self.state_dicts,
            "counts": self.counts(),
            "other_tensors": self.other_tensors,
            "entries": [e.to_dict() for e in self.entries],
        }
