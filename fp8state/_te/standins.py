"""Local stand-ins for the TransformerEngine recipe classes that TE 2.x pickles into checkpoints.

TE pickles its recipe object into every extra state since v2.0 (PR #1335), so the bytes name
``transformer_engine.common.recipe.<Class>``. The allow-list unpickler maps exactly those names
onto the classes below: plain data holders whose only behaviour is to store the pickled fields.
TransformerEngine itself is never imported.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, NamedTuple

from fp8state.errors import LegacyFormatError

__all__ = [
    "TE_RECIPE_MODULE",
    "TEFormat",
    "TEFormatHelper",
    "TEObject",
    "TERecipe",
    "STANDINS",
    "DELAYED_SCALING",
]

#: The module path TE's recipe classes are pickled under, in every release (te_formats.md, 5).
TE_RECIPE_MODULE = "transformer_engine.common.recipe"


class TEFormatHelper(NamedTuple):
    """Stand-in for TE's ``_FormatHelper(max_fwd, max_bwd)``, the value of a ``Format`` member.

    TE pickles it with ``NEWOBJ``, which calls ``__new__(cls, max_fwd, max_bwd)``.
    """

    max_fwd: float
    max_bwd: float


class TEFormat(enum.Enum):
    """Stand-in for TE's ``Format`` enum.

    Python pickles an enum member by value, as ``REDUCE(Format, (_FormatHelper(...),))``, so
    calling the class on the value finds the member.
    """

    E4M3 = (448, 448)
    E5M2 = (57344, 57344)
    HYBRID = (448, 57344)
    E2M1 = (6, 6)  # v2.8+, NVFP4 recipes

    @classmethod
    def _missing_(cls, value: object) -> TEFormat:
        raise LegacyFormatError(
            "['recipe'].fp8_format",
            f"a Format value {tuple(value) if isinstance(value, tuple) else value!r}",
            "one of TE's formats E4M3 (448, 448), E5M2, HYBRID (448, 57344) or E2M1",
            "The checkpoint is corrupt or comes from an unknown TE release.",
        )


class TEObject:
    """Base of the pickled TE dataclasses: keeps the fields ``BUILD`` hands over, nothing else.

    pydantic dataclasses pickle as ``NEWOBJ(cls)`` followed by ``BUILD(instance __dict__)``; the
    allow-list unpickler calls :meth:`__setstate__` with that dict.
    """

    te_name: str = "TEObject"
    #: True for recipes whose extra state carries no tensors (current/block scaling).
    stateless: bool = False

    fields: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> TEObject:
        """Create an empty instance (what ``NEWOBJ`` does before ``BUILD``)."""
        # NEWOBJ passes the pickled arguments (none for pydantic dataclasses); they are ignored,
        # the fields arrive through __setstate__.
        instance = super().__new__(cls)
        instance.fields = {}
        return instance

    def __setstate__(self, state: object) -> None:
        # A (dict, slots-dict) pair is what objects with __slots__ pickle; accept both halves.
        if isinstance(state, tuple) and len(state) == 2:
            merged: dict[Any, Any] = {}
            for part in state:
                if part is not None:
                    if not isinstance(part, Mapping):
                        break
                    merged.update(part)
            else:
                state = merged
        if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
            raise LegacyFormatError(
                "['recipe']",
                f"{self.te_name} state of type {type(state).__name__}",
                "a dict of the recipe's fields",
                "The checkpoint is corrupt.",
            )
        self.fields.update(state)

    def __repr__(self) -> str:
        return f"<TE {self.te_name} {self.fields!r}>"


class TERecipe(TEObject):
    """Stand-in for a TE recipe; :attr:`te_name` says which one."""


def _make(name: str, base: type[TEObject], stateless: bool = False) -> type[TEObject]:
    return type(name, (base,), {"te_name": name, "stateless": stateless, "__module__": __name__})


#: TE names (under :data:`TE_RECIPE_MODULE`) the unpickler accepts, and their stand-ins. The
#: stateless recipes are those TE v2.16.1+ recognise as such (PR #3123); ``CustomRecipe`` is
#: listed, but its ``qfactory`` is a user callable and is refused on its own.
STANDINS: dict[str, Any] = {
    "Format": TEFormat,
    "_FormatHelper": TEFormatHelper,
    "Recipe": _make("Recipe", TERecipe),
    "DelayedScaling": _make("DelayedScaling", TERecipe),
    "Float8CurrentScaling": _make("Float8CurrentScaling", TERecipe, stateless=True),
    "MXFP8BlockScaling": _make("MXFP8BlockScaling", TERecipe, stateless=True),
    "Float8BlockScaling": _make("Float8BlockScaling", TERecipe, stateless=True),
    "NVFP4BlockScaling": _make("NVFP4BlockScaling", TERecipe, stateless=True),
    "CustomRecipe": _make("CustomRecipe", TERecipe),
    "MMParams": _make("MMParams", TEObject),
    "QParams": _make("QParams", TEObject),
    "_OverrideLinearPrecision": _make("_OverrideLinearPrecision", TEObject),
}

#: The stand-in class of ``DelayedScaling``, the only recipe with per-tensor state.
DELAYED_SCALING: type[TEObject] = STANDINS["DelayedScaling"]
