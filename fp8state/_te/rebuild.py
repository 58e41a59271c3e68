"""torch's tensor rebuild functions as the allow-list unpickler hands them to a pickle.

A pickled tensor is a call of ``torch._utils._rebuild_tensor*(storage, offset, size,
stride, ...)``, and ``Tensor.set_`` takes what it is given: a view past its storage's end
grows the storage with uninitialized memory, a stride-0 view of 10**10 rows over three
elements allocates 120 GB on first copy. Every tensor a pickle rebuilds goes through
:func:`check_view` first; pickled backward hooks are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp8state._shown import shown
from fp8state.errors import LegacyFormatError

__all__ = ["MAX_EXPANDED_ELEMENTS", "check_view", "checked_rebuild"]


#: A tensor may view more elements than its storage holds (an expanded view: stride 0) only up
#: to this many: the first copy of a 10**10-row view of a 3-element storage would allocate
#: 120 GB.
MAX_EXPANDED_ELEMENTS = 2**24


def _malformed(found: str) -> LegacyFormatError:
    return LegacyFormatError(
        "",
        found,
        "a tensor inside the bytes its storage holds, as torch.save writes it",
        "The checkpoint is corrupt or was crafted; nothing was read outside the file.",
    )


def check_view(storage: Any, offset: Any, size: Any, stride: Any, dtype: Any = None) -> None:
    """Raise unless a tensor rebuilt from these arguments lies inside ``storage``.

    ``Tensor.set_`` would otherwise grow a storage too small for the view (uninitialized
    memory reported as data) or accept negative numbers. Checked before anything is made.
    """
    untyped = getattr(storage, "_untyped_storage", storage)
    dtype = dtype if dtype is not None else getattr(storage, "dtype", None)
    ints = (
        type(offset) is int
        and isinstance(size, (tuple, list, torch.Size))
        and isinstance(stride, (tuple, list))
        and len(size) == len(stride)
        and all(type(v) is int for v in (*size, *stride))
    )
    if not isinstance(untyped, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise _malformed(f"a tensor built from a {type(storage).__name__}")
    if not ints or offset < 0 or any(v < 0 for v in (*size, *stride)):
        raise _malformed(
            f"a tensor with offset {shown(offset)}, size {shown(size)}, stride {shown(stride)}"
        )
    numel = 1
    for n in size:
        numel *= n
    if numel == 0:
        return
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    item = dtype.itemsize
    held = untyped.nbytes()
    if (last + 1) * item > held:
        raise _malformed(
            f"a tensor of shape {tuple(size)} at offset {offset} reaching byte "
            f"{(last + 1) * item} of a {held}-byte storage"
        )
    if numel * item > held and numel > MAX_EXPANDED_ELEMENTS:
        raise _malformed(
            f"a view of {numel} elements over a {held}-byte storage (limit "
            f"{MAX_EXPANDED_ELEMENTS} elements for views larger than their storage)"
        )


def _names(state: object) -> str:
    parts = state if isinstance(state, tuple) else (state,)
    names = [k for part in parts if isinstance(part, dict) for k in part]
    return shown(sorted(names, key=str)) if names else shown(type(state).__name__)


def checked_rebuild(rebuild: Callable[..., Any], hooks_at: int | None, dtype_at: int | None) -> Any:
    """A torch rebuild function that checks the view (:func:`check_view`) and refuses hooks.

    torch.save never writes hooks (torch's "Don't serialize hooks" note); hooks in a pickle
    could only be callables planted to run at the next backward pass.
    """

    def checked(*args: Any) -> Any:
        if len(args) >= 4 and rebuild.__name__.startswith("_rebuild_tensor"):
            dtype = args[dtype_at] if dtype_at is not None and len(args) > dtype_at else None
            check_view(args[0], args[1], args[2], args[3], dtype)
        if rebuild.__name__ == "_rebuild_parameter_with_state" and len(args) > 3 and args[3]:
            # Attributes set on the Parameter (its `_backward_hooks` among them): torch.save
            # writes them only for Parameter subclasses, never for a module's parameters.
            raise LegacyFormatError(
                "",
                f"a Parameter with pickled attributes {_names(args[3])}"[:200],
                "a plain Parameter (no attributes)",
                "The checkpoint was crafted or holds a Parameter subclass; nothing was set.",
            )
        if hooks_at is not None and len(args) > hooks_at and args[hooks_at]:
            raise LegacyFormatError(
                "",
                f"a tensor with pickled backward hooks {shown(args[hooks_at])}",
                "no hooks (torch.save never writes them)",
                "The checkpoint was crafted; nothing was executed.",
            )
        return rebuild(*args)

    checked.__qualname__ = checked.__name__ = rebuild.__name__
    return checked
