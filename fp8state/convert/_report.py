"""What :func:`fp8state.convert_model` decides for each module, as data a user can inspect."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "PROBLEM_ACTIONS", "ModuleDecision", "PairDecision", "ConversionReport"]

#: ``"convert"``: swapped for its fp8state counterpart. ``"fuse"``: part of a norm + linear
#: pair that became one ``LayerNormLinear``. ``"unsupported"``: a type convert_model swaps, but
#: this instance cannot be (warned about, or an error with ``on_unsupported="raise"``).
#: ``"filtered"``: ``module_filter_fn`` returned False. ``"subclass"``: a subclass of a
#: swappable type, never swapped (see :mod:`fp8state.convert._rules`). ``"unrecognized"``: of
#: no type convert_model knows, but it looks like a linear layer (a 2-D weight and
#: ``in_features``/``out_features``, or a class name saying so); warned about like
#: ``"unsupported"``.
Action = Literal["convert", "fuse", "unsupported", "filtered", "subclass", "unrecognized"]

#: The actions that are problems: in :meth:`ConversionReport.problems`, the warning, and the
#: error of ``on_unsupported="raise"``.
PROBLEM_ACTIONS: tuple[Action, ...] = ("unsupported", "unrecognized")


@dataclass(frozen=True)
class ModuleDecision:
    """What happens to one module.

    Attributes:
        name: The module's name, as ``model.named_modules()`` spells it (its first name when
            the module is reachable under several).
        module_type: Its type (``"torch.nn.Linear"``, ``"transformers.pytorch_utils.Conv1D"``).
        action: See :data:`Action`.
        target: What replaces it (``"fp8state.Linear"``, ``"torch.nn.Identity"``), or ``""``
            when it stays.
        reason: Why, in words.
    """

    name: str
    module_type: str
    action: Action
    target: str
    reason: str

    @property
    def swapped(self) -> bool:
        """True when the module is replaced (``"convert"`` or ``"fuse"``)."""
        return self.action in ("convert", "fuse")


@dataclass(frozen=True)
class PairDecision:
    """What happens to one norm + linear pair asked for (named, or found in a Sequential).

    Attributes:
        norm: Name of the norm.
        linear: Name of the linear layer.
        fused: True when the pair becomes one ``LayerNormLinear``.
        reason: Why not, when not fused (``""`` otherwise).
        filtered: True when ``module_filter_fn`` excluded a member (not a problem to report).
    """

    norm: str
    linear: str
    fused: bool
    reason: str = ""
    filtered: bool = False


@dataclass(frozen=True)
class ConversionReport:
    """Every decision of one conversion: one per candidate module, one per pair asked for.

    Candidates are the model's ``nn.Linear``, ``nn.LayerNorm``, ``nn.RMSNorm`` and Hugging
    Face ``Conv1D`` modules and their subclasses, and the modules that look like linear layers
    without being one of those (``"unrecognized"``); other modules are not listed.
    ``report["blocks.0.fc"]`` is the decision for one module, ``str(report)`` a table.
    """

    modules: tuple[ModuleDecision, ...]
    pairs: tuple[PairDecision, ...] = ()

    def __getitem__(self, name: str) -> ModuleDecision:
        for decision in self.modules:
            if decision.name == name:
                return decision
        raise KeyError(name)

    def __iter__(self) -> Iterator[ModuleDecision]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def swapped(self) -> list[ModuleDecision]:
        """Decisions of modules that get replaced."""
        return [d for d in self.modules if d.swapped]

    def problems(self) -> list[str]:
        """One line per module or pair asked for that cannot be converted as asked."""
        lines = [
            f"{d.name} ({d.module_type}): {d.reason}"
            for d in self.modules
            if d.action in PROBLEM_ACTIONS
        ]
        lines += [
            f"pair ({p.norm}, {p.linear}) not fused: {p.reason}"
            for p in self.pairs
            if not p.fused and not p.filtered
        ]
        return lines

    def __str__(self) -> str:
        rows = [("module", "type", "action", "becomes / reason")]
        rows += [
            (d.name or "(model)", d.module_type, d.action, d.target or d.reason)
            for d in self.modules
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
            for r in rows
        )
