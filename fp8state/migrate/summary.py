"""What ``fp8state inspect`` shows: one row per FP8 module of any checkpoint (ours or TE's).

The era column's codes come with a legend, the TE releases of each era, read from the era table
(:data:`fp8state._te.eras.ERAS`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from fp8state._te.eras import ERAS
from fp8state.checkpoint.dcp_files import load_dcp_state_dict
from fp8state.migrate import migration_report as rpt
from fp8state.migrate.reader import ReadCheckpoint, read_checkpoint
from fp8state.migrate.te_checkpoint import convert_read_checkpoint
from fp8state.schema import as_mapping

__all__ = ["ModuleRow", "CheckpointSummary", "summarize_checkpoint", "era_legend"]

#: Where fp8state puts every tensor it reads from a checkpoint (then onto the module's device).
LOADS_ONTO = "cpu"


def era_legend(eras: Iterable[str]) -> dict[str, str]:
    """Each TE era code among ``eras`` with the TE releases that wrote it, in era order.

    Other labels (``"fp8state schema v1"``, the era groups of values without FP8 state such as
    ``"E09/E10"``) say what they are and have no entry.

    Example:
        >>> era_legend(["E08-E10", "fp8state schema v1", "E01", "E08-E10"])
        {'E01': 'TE v0.1-v0.2', 'E08-E10': 'TE v2.0-v2.20'}
    """
    seen = set(eras)
    return {code: f"TE {era.te_tags}" for code, era in ERAS.items() if code in seen}


def _range(t: torch.Tensor) -> tuple[float, float] | None:
    return (float(t.min()), float(t.max())) if t.numel() else None


def _fmt_range(r: tuple[float, float] | None) -> str:
    return "-" if r is None else f"[{r[0]:.4g}, {r[1]:.4g}]"


@dataclass(frozen=True)
class ModuleRow:
    """One FP8 module of a checkpoint.

    Attributes:
        module: State-dict prefix of the module (``"blocks.0.mlp"``).
        era: TE era or ``"fp8state schema v1"``.
        container: How the extra state was stored.
        slots: ``(forward, backward)`` slot counts after conversion.
        te_slots: TE's counts where they differ (TE v0.1-v0.5 kept 2 / 1 per GEMM), else None.
        rows: History rows.
        scale_range: ``(min, max)`` over every slot's scale, both directions.
        amax_range: ``(min, max)`` over the recorded (non-zero) amaxes, None if none recorded.
        recipe: The recipe as plain values, and where it came from.
        saved_locations: Location tags the module's tensors were saved with; a plain
            ``torch.load`` without ``map_location`` would put them there. fp8state reads them
            onto the CPU (:data:`LOADS_ONTO`).
    """

    module: str
    era: str
    container: str
    slots: tuple[int, int]
    te_slots: tuple[int, int] | None
    rows: int
    scale_range: tuple[float, float] | None
    amax_range: tuple[float, float] | None
    recipe: dict[str, Any]
    recipe_source: str
    defaulted: tuple[str, ...]
    saved_locations: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "module": self.module,
            "era": self.era,
            "container": self.container,
            "slots": {"fwd": self.slots[0], "bwd": self.slots[1]},
            "te_slots": None
            if self.te_slots is None
            else {"fwd": self.te_slots[0], "bwd": self.te_slots[1]},
            "history_rows": self.rows,
            "scale_range": self.scale_range,
            "amax_range": self.amax_range,
            "recipe": self.recipe,
            "recipe_source": self.recipe_source,
            "defaulted_recipe_fields": list(self.defaulted),
            "saved_locations": list(self.saved_locations),
            "loads_onto": LOADS_ONTO,
        }

    def cells(self) -> list[str]:
        """Table cells, in :data:`_HEADER` order."""
        r = self.recipe
        recipe = (
            f"{r['fp8_format']} m={r['margin']} len={r['amax_history_len']} "
            f"{r['amax_compute_algo']}" + (" (defaults)" if self.defaulted else "")
        )
        slots = f"{self.slots[0]}/{self.slots[1]}"
        if self.te_slots is not None:
            slots = f"{self.te_slots[0]}/{self.te_slots[1]}->{slots}"
        return [
            self.module,
            self.era,
            slots,
            str(self.rows),
            _fmt_range(self.scale_range),
            _fmt_range(self.amax_range),
            recipe,
            ",".join(self.saved_locations) or "-",
        ]


_HEADER = ["module", "era", "slots f/b", "rows", "scale", "amax", "recipe", "saved on"]


@dataclass
class CheckpointSummary:
    """Rows for the FP8 modules and the entries without FP8 state."""

    source: str
    state_dicts: list[str]
    rows: list[ModuleRow] = field(default_factory=list)
    without_state: list[rpt.EntryReport] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document ``fp8state inspect --json`` prints.

        ``"eras"`` is the legend (:func:`era_legend`) of every TE era code in it, of the
        modules and of the entries without FP8 state.
        """
        eras = [row.era for row in self.rows] + [e.era for e in self.without_state]
        return {
            "source": self.source,
            "state_dicts": self.state_dicts,
            "loads_onto": LOADS_ONTO,
            "eras": era_legend(eras),
            "modules": [row.to_dict() for row in self.rows],
            "without_fp8_state": [
                {
                    "key": e.key,
                    "era": e.era,
                    "container": e.container,
                    "migrate_action": e.action,
                    "notes": list(e.notes),
                }
                for e in self.without_state
            ],
        }

    def format_table(self) -> str:
        """A fixed-width table, the legend of its eras, then a line about entries without state."""
        return "\n".join(self.table_lines())

    def table_lines(self) -> list[str]:
        """:meth:`format_table`'s lines, one string each (a key may hold a newline itself)."""
        table = [_HEADER] + [row.cells() for row in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(_HEADER))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in table
        ]
        lines += [f"era {code}: {te}" for code, te in era_legend(r.era for r in self.rows).items()]
        lines.append(
            f"{len(self.rows)} FP8 module(s) in {self.source}; fp8state reads every "
            f"tensor onto {LOADS_ONTO}, then onto the loading module's device."
        )
        if self.without_state:
            names = ", ".join(e.key for e in self.without_state)
            lines.append(f"{len(self.without_state)} extra state(s) without FP8 state: {names}")
        return lines


def _row(entry: rpt.EntryReport) -> ModuleRow:
    assert entry.payload is not None and entry.recipe is not None
    payload = as_mapping(entry.payload)
    scales = torch.cat([payload["fwd.scale"], payload["bwd.scale"]])
    amaxes = torch.cat(
        [payload["fwd.amax_history"].reshape(-1), payload["bwd.amax_history"].reshape(-1)]
    )
    recipe = rpt.recipe_dict(entry.recipe)
    assert recipe is not None
    key = entry.key.rsplit("/", 1)[-1]
    slots = (int(payload["fwd.scale"].numel()), int(payload["bwd.scale"].numel()))
    return ModuleRow(
        module=key[: -len("_extra_state")].rstrip(".") or "<root>",
        era=entry.era,
        container=entry.container,
        slots=slots,
        te_slots=None if entry.te_slots in (None, slots) else entry.te_slots,
        rows=int(payload["fwd.amax_history"].shape[0]),
        scale_range=_range(scales),
        amax_range=_range(amaxes[amaxes > 0]),
        recipe=recipe,
        recipe_source=entry.recipe_source,
        defaulted=entry.defaulted,
        saved_locations=entry.locations,
    )


def _read(source: str | os.PathLike[str] | IO[bytes]) -> ReadCheckpoint:
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        # A folder can only be a DCP checkpoint (load_dcp_state_dict says so if it is not).
        # DCP records no devices, so its rows have no saved locations.
        state = load_dcp_state_dict(source, trusted=False)
        return ReadCheckpoint(state, os.fspath(source))
    return read_checkpoint(source)


def summarize_checkpoint(source: str | os.PathLike[str] | IO[bytes]) -> CheckpointSummary:
    """Read a checkpoint (fp8state's or TE's, any era) safely and describe its FP8 modules.

    ``source`` is a ``torch.save`` file (a path or a binary file object), or a
    ``torch.distributed.checkpoint`` folder. Nothing pickled in either runs: files go through
    the allow-list unpickler, folders through ``load_dcp_state_dict(..., trusted=False)``.

    Raises:
        UnsafeCheckpointError, LegacyFormatError, SchemaError: as
            :func:`fp8state.migrate.load_te_checkpoint` with ``strict=True``.
        CheckpointError: a folder that is not a readable DCP checkpoint.
    """
    _, report = convert_read_checkpoint(_read(source), strict=True)
    summary = CheckpointSummary(report.source, report.state_dicts)
    for entry in report.entries:
        if entry.action in (rpt.CONVERTED, rpt.KEPT):
            summary.rows.append(_row(entry))
        else:
            summary.without_state.append(entry)
    return summary
