"""The allow-list unpickler: reads TE checkpoints and pickled extra states without running code.

A pickle is a program: each global it names is imported and may be called. This module resolves
names only from :data:`ALLOWED` (torch's tensor rebuild functions, plain containers, scalars and
stand-ins for TE's recipe classes); any other name raises
:class:`~fp8state.errors.UnsafeCheckpointError` before anything is imported or called. ``BUILD``
(which sets attributes on an object) is restricted to the few types that legitimately need it.

The module is itself a valid ``pickle_module`` for ``torch.load`` (it has ``Unpickler`` and
``load``), which is how outer checkpoint files are read: torch resolves its storage records and
this unpickler everything else. Nested legacy storage blobs (``torch.storage._load_from_bytes``)
are read with ``torch.load(weights_only=True)`` onto the CPU.
"""

from __future__ import annotations

import _compat_pickle
import collections
import contextlib
import contextvars
import io
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any, BinaryIO

import torch

from fp8state._te.allowed import NAMES, refuse_call, setstate_checked
from fp8state._te.hash_budget import budget_for, sharing
from fp8state._te.hash_scan import check_hash_cost
from fp8state.errors import FP8StateError, LegacyFormatError, UnsafeCheckpointError

__all__ = [
    "ALLOWED",
    "Unpickler",
    "load",
    "loads",
    "load_storage_blob",
    "safe_torch_load",
    "collecting_locations",
]

_UNSAFE_FIX = (
    "Nothing was executed. fp8state decodes TE checkpoints without running pickled code; if you "
    "trust this file, load it yourself (torch.load(..., weights_only=False)) and pass the state "
    "dict to fp8state.migrate.convert_te_state_dict."
)


# The pure-Python unpickler (typeshed only knows the C one, hence Any).
_PyUnpickler: Any = pickle._Unpickler  # type: ignore[attr-defined]


class Unpickler(_PyUnpickler):
    """``pickle.Unpickler`` that resolves globals from :data:`ALLOWED` only.

    The pure-Python unpickler is used on purpose: its opcode table can be edited. Every opcode
    that calls what ``find_class`` returned refuses the classes allowed only as markers, and
    ``BUILD`` (which sets state on an object) reaches only objects this load itself created,
    through :meth:`setstate`'s checks: never a class, a function or anything else reachable
    from a module, so no load changes the process. Every opcode that hashes (a dict key, a set
    element, the items of a ``set``/``OrderedDict`` call, a persistent id) charges it first
    to the load's :class:`~fp8state._te.hash_budget.HashBudget`. Other readers (DCP's
    metadata) subclass it with their own ``find_class`` and :meth:`setstate`.

    Raises:
        UnsafeCheckpointError: the pickle names a global outside the allow-list.
        LegacyFormatError: it calls a marker, sets state it may not, or builds keys whose
            hashing would pass the budget.
    """

    dispatch = dict(_PyUnpickler.dispatch)

    def __init__(self, file: IO[bytes], *args: Any, **kwargs: Any) -> None:
        super().__init__(file, *args, **kwargs)
        # id -> object for everything a call in this load made; the objects are kept, so an
        # id cannot be reused by another object while the load runs.
        self._created: dict[int, object] = {}
        self._hashing = budget_for(file)

    def load(self) -> Any:
        """Unpickle; storage blobs read meanwhile draw on this load's hash budget."""
        with sharing(self._hashing):
            return _PyUnpickler.load(self)

    def _made(self) -> None:
        made = self.stack[-1]
        self._created[id(made)] = made

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if self._created.get(id(inst)) is not inst:
            raise LegacyFormatError(
                "",
                f"a pickle setting the state of a {type(inst).__name__} object it did not create",
                "state set only on objects the pickle itself built",
                "The checkpoint is corrupt or was crafted; nothing was executed.",
            )
        self.setstate(inst, state)

    def setstate(self, inst: object, state: object) -> None:
        """``BUILD`` on an object this load created: the types TE checkpoints need."""
        setstate_checked(inst, state)

    # Every opcode that calls or instantiates what find_class returned checks it first.
    def _load_reduce(self) -> None:
        refuse_call(self.stack[-2])
        self._charge_call(self.stack[-2], self.stack[-1])
        _PyUnpickler.load_reduce(self)
        self._made()

    # Every opcode that hashes what the pickle built charges it to the load's budget first.
    # After a MARK, `self.stack` holds exactly the items the opcode consumes.
    def _charge(self, keys: Any) -> None:
        self._hashing.charge_all(keys)

    def _charge_call(self, target: object, args: object) -> None:
        """The keys ``set(...)`` or ``OrderedDict(...)`` would hash."""
        # REDUCE calls func(*args) with any sequence as args, a list too.
        if target in (set, collections.OrderedDict) and isinstance(args, (tuple, list)) and args:
            self._hashing.charge_items(args[0], pairs=target is not set)

    def _load_binpersid(self) -> None:
        # torch's persistent_load looks the id up in a dict: it hashes it.
        self._hashing.charge(self.stack[-1])
        _PyUnpickler.load_binpersid(self)

    def _load_setitem(self) -> None:
        self._hashing.charge(self.stack[-2])
        _PyUnpickler.load_setitem(self)

    def _load_setitems(self) -> None:
        self._charge(self.stack[0::2])
        _PyUnpickler.load_setitems(self)

    def _load_dict(self) -> None:
        self._charge(self.stack[0::2])
        _PyUnpickler.load_dict(self)

    def _load_additems(self) -> None:
        self._charge(self.stack)
        _PyUnpickler.load_additems(self)

    def _load_frozenset(self) -> None:
        self._charge(self.stack)
        _PyUnpickler.load_frozenset(self)

    def _load_newobj(self) -> None:
        refuse_call(self.stack[-2])
        _PyUnpickler.load_newobj(self)
        self._made()

    def _load_newobj_ex(self) -> None:
        refuse_call(self.stack[-3])
        _PyUnpickler.load_newobj_ex(self)
        self._made()

    def _instantiate(self, klass: Any, args: Any) -> None:  # OBJ and INST (protocols 0, 1)
        refuse_call(klass)
        self._charge_call(klass, tuple(args))
        _PyUnpickler._instantiate(self, klass, args)
        self._made()

    dispatch[pickle.BUILD[0]] = _load_build

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BINPERSID[0]] = _load_binpersid
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    dispatch[pickle.FROZENSET[0]] = _load_frozenset

    def find_class(self, module: str, name: str) -> Any:
        """Resolve ``module.name`` from the allow-list; never imports anything."""
        # Python-2 names in protocol < 3 pickles (torch.save writes protocol 2), as pickle does.
        if self.proto < 3 and self.fix_imports:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        key = (str(module), str(name))
        if key in ALLOWED:
            return ALLOWED[key]
        te = module == "transformer_engine" or str(module).startswith("transformer_engine.")
        # Names come from the file: escape control characters so the message stays one line.
        shown = _clip(ascii(f"{module}.{name}")[1:-1], 120)
        raise UnsafeCheckpointError(
            "",
            f"a pickled reference to {shown}"
            + (" (a TransformerEngine class fp8state does not know)" if te else ""),
            "only torch tensor/storage rebuild functions, plain containers and TE recipe classes",
            _UNSAFE_FIX,
        )


def load(file: BinaryIO, **kwargs: Any) -> Any:
    """``pickle.load`` through :class:`Unpickler` (the ``pickle_module`` protocol)."""
    return Unpickler(file, **kwargs).load()


def _clip(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _undecodable(what: str, err: BaseException, expected: str) -> LegacyFormatError:
    return LegacyFormatError(
        "",
        f"{what} that cannot be decoded ({type(err).__name__}: {_clip(str(err))})",
        expected,
        "The file is truncated or corrupt; re-copy it, or use another checkpoint.",
    )


def loads(data: bytes) -> Any:
    """Unpickle ``data`` through the allow-list.

    Raises:
        UnsafeCheckpointError: a global outside the allow-list.
        LegacyFormatError: anything else that goes wrong (truncated or random bytes).
    """
    try:
        return Unpickler(io.BytesIO(data)).load()
    except FP8StateError:
        raise
    except Exception as err:  # random bytes raise anything from KeyError to MemoryError
        raise _undecodable(f"{len(data)} bytes of pickle data", err, "a pickle TE wrote") from None


# Storage location tags ("cpu", "cuda:0") seen while reading, for `fp8state inspect`.
_locations: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "fp8state_migrate_locations", default=None
)


@contextlib.contextmanager
def collecting_locations() -> Iterator[set[str]]:
    """Collect the location tags of every storage read inside the ``with`` block."""
    seen: set[str] = set()
    token = _locations.set(seen)
    try:
        yield seen
    finally:
        _locations.reset(token)


def _keep_on_cpu(storage: Any, location: str) -> Any:
    """``map_location`` callable: record the saved tag, keep the CPU storage torch just read.

    Returning the storage as it is means a ``cuda:N`` tag never reaches torch's CUDA
    deserializer: no CUDA context, no allocation, also on machines without a GPU.
    """
    seen = _locations.get()
    if seen is not None:
        seen.add(str(location))
    return storage


def _name_refused_global(blob: bytes) -> UnsafeCheckpointError | None:
    """Which global made the weights-only reader refuse ``blob``, named exactly.

    torch's message mangles names (protocol-2 pickles map ``subprocess`` to ``commands``), so the
    blob is read once more through the allow-list, which refuses the same global before anything
    runs and names it as pickled.
    """
    try:
        safe_torch_load(io.BytesIO(blob))
    except UnsafeCheckpointError as err:
        return UnsafeCheckpointError(
            err.key, f"{err.found} inside a nested storage blob", err.expected, err.fix
        )
    except FP8StateError:
        return None
    return None


def load_storage_blob(blob: object) -> Any:
    """Replacement of ``torch.storage._load_from_bytes``: a storage read weights-only onto CPU.

    TE v0.6-v2.x pickles hold each tensor's storage as a nested legacy ``torch.save`` blob;
    torch's own function would read it with ``weights_only=False`` onto the saved device.
    """
    if not isinstance(blob, (bytes, bytearray)):
        raise LegacyFormatError(
            "",
            f"a storage blob of type {type(blob).__name__}",
            "bytes of a torch.save storage",
            "The checkpoint is corrupt or was crafted; nothing was executed.",
        )
    # torch's reader hashes every key the blob's pickles build: bounded first.
    check_hash_cost(bytes(blob), "a nested storage blob")
    try:
        storage = torch.load(io.BytesIO(blob), weights_only=True, map_location=_keep_on_cpu)
    except Exception as err:
        refused = (
            _name_refused_global(bytes(blob)) if isinstance(err, pickle.UnpicklingError) else None
        )
        if refused is not None:
            raise refused from None
        raise _undecodable("a nested storage blob", err, "a torch.save storage") from None
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)):
        raise LegacyFormatError(
            "",
            f"a nested blob holding a {type(storage).__name__}",
            "a tensor storage",
            "The checkpoint is corrupt or was crafted.",
        )
    return storage


def safe_torch_load(
    file: str | IO[bytes], on_storage: Callable[[Any, str], None] | None = None
) -> Any:
    """``torch.load`` onto the CPU with this module as ``pickle_module``.

    Args:
        file: A path or a binary file object (a torch.save archive, zip or legacy).
        on_storage: Called with each storage torch reads and its saved location tag.

    Raises:
        UnsafeCheckpointError: a global outside the allow-list.
        LegacyFormatError: the data cannot be read (truncated, corrupt, not a torch.save file).
        FileNotFoundError, PermissionError, IsADirectoryError: as ``open`` raises them.
    """

    def restore(storage: Any, location: str) -> Any:
        if on_storage is not None:
            on_storage(storage, location)
        return _keep_on_cpu(storage, location)

    try:
        # weights_only=False is required with a pickle_module; the allow-list above is what
        # keeps this load safe, and mmap=False keeps the result independent of the file.
        return torch.load(
            file,
            map_location=restore,
            pickle_module=sys.modules[__name__],
            weights_only=False,
            mmap=False,
        )
    except (FP8StateError, FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as err:
        if "explicit pickle_module" in str(err):
            raise UnsafeCheckpointError(
                "TORCH_FORCE_WEIGHTS_ONLY_LOAD",
                "the variable set",
                "it unset while fp8state reads a TE checkpoint",
                "Unset it for this command: fp8state reads TE pickles through its own allow-list, "
                "which is at least as strict as weights_only.",
            ) from None
        raise _undecodable("a checkpoint", err, "a torch.save archive") from None


#: Every global a pickle may name, as ``(module, name) -> object``: the names of
#: :data:`fp8state._te.allowed.NAMES` and the nested storage reader above.
ALLOWED: dict[tuple[str, str], Any] = {
    **NAMES,
    ("torch.storage", "_load_from_bytes"): load_storage_blob,
}
