"""What a pickle would make its reader hash, measured before a reader fp8state cannot edit runs.

``torch.load(weights_only=True)`` builds the dicts and sets a pickle asks for and so hashes
their keys: a 150-byte file with a 48-deep shared tuple as a key never finishes loading.
fp8state's own unpickler charges every key as it goes (:mod:`fp8state._te.hash_budget`);
torch's cannot be edited, so :func:`check_hash_cost` runs the pickle once through a dry
run that imports nothing, calls nothing and keeps no tensor, charging what the real load
would hash: dict keys, set elements, the keys of ``OrderedDict``, ``Counter``, ``set``,
``frozenset`` and ``dict`` calls, pairs given to ``BUILD``, persistent ids (torch looks each
up in a dict). A call's result is taken to hash like the tuple of its arguments (tensors,
sizes and dtypes hash no deeper). The dry run reads strings as torch does (UTF-8) and any
protocol number; a pickle it still cannot read is left to torch's reader, which reports it.
A ``torch.save`` archive is scanned through its ``data.pkl`` (read by torch's own zip
reader); a pre-1.6 file through its five pickles, the last one's storage keys included (torch
looks each up in a dict).
"""

from __future__ import annotations

import io
import os
import pickle
from typing import IO, Any

import torch

from fp8state._te.hash_budget import budget_for
from fp8state.errors import FP8StateError, LegacyFormatError

__all__ = ["check_hash_cost", "check_file_hash_cost"]

_ZIP_MAGIC = b"PK\x03\x04"
# A pre-1.6 torch.save file: magic number, protocol, system information, the object, its
# storage keys.
_LEGACY_PICKLES = 5

_PyUnpickler: Any = pickle._Unpickler  # type: ignore[attr-defined]

# Calls that hash what they are given: their first argument's keys or elements.
_HASHING_CALLS = frozenset(
    (module, name)
    for module in ("builtins", "__builtin__")  # protocol-2 pickles say __builtin__
    for name in ("set", "frozenset", "dict")
) | {("collections", "OrderedDict"), ("collections", "Counter")}

# Calls whose first argument holds (key, value) pairs; the others hash its elements.
_PAIRS = frozenset({"OrderedDict", "dict"})


class _Global:
    """A name the pickle refers to; never imported."""

    __slots__ = ("name",)

    def __init__(self, name: tuple[str, str]) -> None:
        self.name = name


class _Made:
    """Anything the real load would build by calling or instantiating: hashes by identity."""

    __slots__ = ()


class _DryRun(_PyUnpickler):
    dispatch = dict(_PyUnpickler.dispatch)

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, encoding="utf-8")  # as torch's readers decode str
        self._hashing = budget_for(file)

    def find_class(self, module: str, name: str) -> Any:
        return _Global((str(module), str(name)))

    def persistent_load(self, pid: object) -> Any:
        self._hashing.charge(pid)  # torch looks the id up in a dict
        return _Made()

    def _charge(self, keys: Any) -> None:
        self._hashing.charge_all(keys)

    def _call(self, target: object, args: object) -> object:
        if not isinstance(args, (tuple, list)):  # REDUCE takes any sequence as arguments
            return _Made()
        if isinstance(target, _Global) and target.name in _HASHING_CALLS and args:
            self._hashing.charge_items(args[0], pairs=target.name[1] in _PAIRS)
            return _Made()
        return tuple(args)

    def _load_proto(self) -> None:
        self.proto = self.read(1)[0]  # any number: torch's reader only warns

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def _load_newobj_ex(self) -> None:
        self.stack.pop()  # keyword arguments
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def _instantiate(self, klass: Any, args: Any) -> None:
        self.append(self._call(klass, tuple(args)))

    def _load_build(self) -> None:
        state = self.stack.pop()
        # BUILD updates an instance dict from the state: a list of pairs is hashed there.
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if isinstance(part, (list, tuple)):
                self._hashing.charge_items(part, pairs=True)

    # Dicts are built for real, each key charged first: a later call may hash them again.
    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._hashing.charge(key)
        if type(self.stack[-1]) is dict:
            self.stack[-1][key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        self._charge(items[0::2])
        if type(self.stack[-1]) is dict:
            self.stack[-1].update(zip(items[0::2], items[1::2], strict=False))

    def _load_dict(self) -> None:
        items = self.pop_mark()
        self._charge(items[0::2])
        self.append(dict(zip(items[0::2], items[1::2], strict=False)))

    def _load_additems(self) -> None:
        self._charge(self.pop_mark())

    def _load_frozenset(self) -> None:
        self._charge(self.pop_mark())
        self.append(_Made())

    def _load_append(self) -> None:
        value = self.stack.pop()
        if type(self.stack[-1]) is list:  # lists stay real: a later call may hash their pairs
            self.stack[-1].append(value)

    def _load_appends(self) -> None:
        items = self.pop_mark()
        if type(self.stack[-1]) is list:
            self.stack[-1].extend(items)

    for _op, _fn in (
        (pickle.PROTO, _load_proto),
        (pickle.REDUCE, _load_reduce),
        (pickle.NEWOBJ, _load_newobj),
        (pickle.NEWOBJ_EX, _load_newobj_ex),
        (pickle.BUILD, _load_build),
        (pickle.SETITEM, _load_setitem),
        (pickle.SETITEMS, _load_setitems),
        (pickle.DICT, _load_dict),
        (pickle.ADDITEMS, _load_additems),
        (pickle.FROZENSET, _load_frozenset),
        (pickle.APPEND, _load_append),
        (pickle.APPENDS, _load_appends),
    ):
        dispatch[_op[0]] = _fn
    del _op, _fn


def _scan(file: IO[bytes], pickles: int) -> None:
    """Dry-run ``pickles`` consecutive pickles; the last one's list items are looked up."""
    result: object = None
    try:
        for _ in range(pickles):
            dry = _DryRun(file)
            result = dry.load()
    except FP8StateError:
        raise
    except Exception:  # malformed: the real reader says how, in its own words
        return
    if pickles == _LEGACY_PICKLES and isinstance(result, list):
        for key in result:  # torch checks each storage key against a dict
            dry._hashing.charge(key)


def _archive_pickle(source: str | IO[bytes]) -> bytes | None:
    """``data.pkl`` of a ``torch.save`` archive, read by torch's own zip reader; or None."""
    try:
        return bytes(torch._C.PyTorchFileReader(source).get_record("data.pkl"))
    except (RuntimeError, OSError, TypeError):
        return None


def _checked(data: bytes, key: str, pickles: int) -> None:
    try:
        _scan(io.BytesIO(data), pickles)
    except FP8StateError as err:
        raise LegacyFormatError(key, err.found, err.expected, err.fix) from None


def check_hash_cost(data: bytes, key: str = "") -> None:
    """Raise if ``torch.load(weights_only=True)`` of ``data`` would hash past its budget.

    Args:
        data: A ``torch.save`` file's bytes: an archive, or the pre-1.6 format.
        key: What to name in the error.

    Raises:
        LegacyFormatError: keys whose hashing visits more elements than
            :func:`fp8state._te.hash_budget.budget_for` allows, or of a type whose hash is
            not known to be cheap.
    """
    if data[:4] == _ZIP_MAGIC:
        record = _archive_pickle(io.BytesIO(data))
        if record is not None:
            _checked(record, key, 1)
    else:
        _checked(data, key, _LEGACY_PICKLES)


def check_file_hash_cost(source: str | os.PathLike[str] | IO[bytes], key: str = "") -> None:
    """:func:`check_hash_cost` of a file, reading only an archive's ``data.pkl`` from it.

    A file object is left where it was.

    Raises:
        LegacyFormatError: as :func:`check_hash_cost`.
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as file:
            magic = file.read(4)
            if magic != _ZIP_MAGIC:
                _checked(magic + file.read(), key, _LEGACY_PICKLES)
                return
        record = _archive_pickle(os.fspath(source))
    else:
        start = source.tell()
        try:
            magic = source.read(4)
            source.seek(start)
            if magic != _ZIP_MAGIC:
                _checked(source.read(), key, _LEGACY_PICKLES)
                return
            record = _archive_pickle(source)
        finally:
            source.seek(start)
    if record is not None:
        _checked(record, key, 1)
