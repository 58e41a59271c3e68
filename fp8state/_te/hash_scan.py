"""What a pickle would make its reader hash, measured before a reader fp8state cannot edit runs.

``torch.load(weights_only=True)`` builds the dicts and sets a pickle asks for and so hashes
their keys: a 150-byte file with a 48-deep shared tuple as a key never finishes loading.
fp8state's own unpickler charges every key as it goes (:mod:`fp8state._te.hash_budget`);
torch's cannot be edited, so :func:`check_hash_cost` runs the pickle once through a dry
run that imports nothing, calls nothing and keeps no tensor, charging what the real load
would hash: dict keys, set elements, and the keys of ``OrderedDict``, ``set``, ``frozenset``
and ``dict`` calls. A call's result is taken to hash like the tuple of its arguments
(tensors, sizes and dtypes hash no deeper), so the scan never charges less than the load.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from fp8state._te.hash_budget import budget_for
from fp8state.errors import FP8StateError, LegacyFormatError

__all__ = ["check_hash_cost"]

_PyUnpickler: Any = pickle._Unpickler  # type: ignore[attr-defined]

# Calls that hash what they are given: their first argument's keys or elements.
_HASHING_CALLS = frozenset(
    {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "dict"),
        ("__builtin__", "set"),  # protocol-2 names
        ("__builtin__", "frozenset"),
        ("__builtin__", "dict"),
    }
)


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

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._hashing = budget_for(file)

    def find_class(self, module: str, name: str) -> Any:
        return _Global((str(module), str(name)))

    def persistent_load(self, pid: object) -> Any:
        return _Made()

    def _charge(self, keys: Any) -> None:
        for key in keys:
            self._hashing.charge(key)

    def _call(self, target: object, args: object) -> object:
        if not isinstance(args, tuple):
            return _Made()
        if isinstance(target, _Global) and target.name in _HASHING_CALLS and args:
            pairs = target.name[1] in ("OrderedDict", "dict")
            self._hashing.charge_items(args[0], pairs)
            return _Made()
        return args

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
        self.stack.pop()  # state: set on an object, hashing nothing that was not charged

    def _load_setitem(self) -> None:
        self.stack.pop()
        self._hashing.charge(self.stack.pop())

    def _load_setitems(self) -> None:
        self._charge(self.pop_mark()[0::2])

    def _load_dict(self) -> None:
        self._charge(self.pop_mark()[0::2])
        self.append({})

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


def check_hash_cost(data: bytes, key: str = "", pickles: int = 1) -> None:
    """Raise if unpickling ``data`` would hash more than its budget allows.

    Args:
        data: Pickles one after another: a ``torch.save`` archive's ``data.pkl`` (one), or
            a pre-1.6 ``torch.save`` file (five: magic number, protocol, system information,
            the object, its storage keys; raw storage bytes follow).
        key: What to name in the error (the file).
        pickles: How many consecutive pickles to scan.

    Raises:
        LegacyFormatError: keys whose hashing visits more elements than
            :func:`fp8state._te.hash_budget.budget_for` allows, or of a type whose hash is
            not known to be cheap. A pickle the dry run cannot read is left to the real
            reader, which reports it.
    """
    file = io.BytesIO(data)
    try:
        for _ in range(pickles):
            _DryRun(file).load()
    except FP8StateError as err:
        raise LegacyFormatError(key, err.found, err.expected, err.fix) from None
    except Exception:  # malformed: the real reader says how, in its own words
        return
