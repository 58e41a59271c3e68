"""What a pickle read by fp8state's allow-list unpickler may name, call and give state to.

The allow-list (:data:`NAMES`): torch's tensor rebuild functions (each wrapped in the view check
of :mod:`fp8state._te.rebuild`), sizes, devices and dtypes, plain containers, and stand-ins for
TE's recipe classes. :func:`refuse_call` keeps the classes allowed only as markers from being
called; :func:`setstate_checked` is the only ``BUILD`` a TE checkpoint needs.
"""

from __future__ import annotations

import collections
import io
from typing import Any

import torch

from fp8state._te import standins
from fp8state._te.rebuild import checked_rebuild
from fp8state.errors import LegacyFormatError

__all__ = ["NAMES", "MARKERS", "refuse_call", "setstate_checked"]


def _latin1_encode(obj: object, encoding: object = "utf-8") -> bytes:
    """``_codecs.encode`` restricted to what protocol-2 pickles use it for: bytes as latin-1."""
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise LegacyFormatError(
            "",
            f"_codecs.encode({type(obj).__name__}, {encoding!r})",
            "_codecs.encode(str, 'latin1'), how protocol-2 pickles store bytes",
            "The checkpoint is corrupt or was not written by torch.save/pickle.",
        )
    return obj.encode("latin-1")


def _torch_allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        # Building a device object neither touches nor initialises the device.
        ("torch", "device"): torch.device,
    }
    # Positions of `backward_hooks` and of an explicit dtype in each rebuild function's
    # arguments (the first four of a tensor's are storage, offset, size, stride).
    for name, hooks_at, dtype_at in (
        ("_rebuild_tensor", None, None),
        ("_rebuild_tensor_v2", 5, None),
        ("_rebuild_tensor_v3", 5, 6),
        ("_rebuild_parameter", 2, None),
        ("_rebuild_parameter_with_state", 2, None),
    ):
        allowed[("torch._utils", name)] = checked_rebuild(
            getattr(torch._utils, name), hooks_at, dtype_at
        )
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    # The storage marker torch.save writes for dtypes without a legacy storage class (float8,
    # uint16 ...): torch.load compares it by identity. A marker only, never called
    # (MARKERS): calling it would allocate whatever size the file asks for.
    allowed[("torch.storage", "UntypedStorage")] = torch.UntypedStorage
    return allowed


# Classes a pickle may name but never call or instantiate (REDUCE, NEWOBJ, OBJ, INST).
MARKERS: tuple[type, ...] = (torch.UntypedStorage,)


def refuse_call(target: object) -> None:
    if isinstance(target, type) and issubclass(target, MARKERS):
        raise LegacyFormatError(
            "",
            f"a pickle calling {target.__module__}.{target.__name__}",
            "that class named only as a storage type, as torch.save writes it",
            "The checkpoint is corrupt or was crafted; nothing was executed.",
        )


#: Every global a pickle may name but the nested storage reader (which reads through the
#: unpickler and is added there), as ``(module, name) -> object``. Storage classes
#: (``torch.FloatStorage`` ...) are resolved by ``torch.load`` itself, as dtype markers.
NAMES: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    # TE v0.3-v0.4 FP8 activation recompute buffers (te_formats.md, E02).
    ("collections", "deque"): collections.deque,
    ("builtins", "set"): set,
    ("builtins", "complex"): complex,
    # TE v0.12-v1.13 put an io.BytesIO object into the state dict (E06, E07).
    ("_io", "BytesIO"): io.BytesIO,
    ("io", "BytesIO"): io.BytesIO,
    ("_codecs", "encode"): _latin1_encode,
    **{(standins.TE_RECIPE_MODULE, name): cls for name, cls in standins.STANDINS.items()},
}


def setstate_checked(inst: object, state: object) -> None:
    """``BUILD``: the only types whose state a TE checkpoint legitimately restores."""
    if type(inst) is io.BytesIO:
        # BytesIO.__reduce__ state: (bytes, position, __dict__ or None). The dict is empty once
        # anything looked an attribute up (DCP does before it saves one); nothing else is set.
        ok = (
            isinstance(state, tuple)
            and len(state) == 3
            and isinstance(state[0], (bytes, bytearray))
            and isinstance(state[1], int)
            and (state[2] is None or (type(state[2]) is dict and not state[2]))
        )
        if ok:
            inst.__setstate__(state)  # type: ignore[attr-defined]
            return
    elif isinstance(inst, standins.TEObject):
        inst.__setstate__(state)
        return
    elif type(inst) is collections.OrderedDict:
        # state_dict() OrderedDicts carry one attribute, `_metadata` (module versions), and
        # nothing else: an attribute named `keys`, `items` or `get` would shadow the mapping's
        # methods for every reader after this one.
        if isinstance(state, dict) and set(state) <= {"_metadata"}:
            inst.__dict__.update(state)
            return
    raise LegacyFormatError(
        "",
        f"a pickle setting the state of a {type(inst).__name__} object",
        "state only for io.BytesIO, OrderedDict and TE recipe objects",
        "The checkpoint is corrupt or was crafted; nothing was executed.",
    )


NAMES.update(_torch_allowed())
