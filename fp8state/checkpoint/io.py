"""Read a ``torch.save`` checkpoint safely: weights only, onto the CPU, with errors that say why.

:func:`load` is ``torch.load(weights_only=True, map_location="cpu")`` plus what a user needs when
it fails: a TransformerEngine checkpoint is recognised and pointed at ``fp8state migrate``, a
pickle that asks for code is refused by name, and a distributed-checkpoint folder is pointed at
the functions that read it.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import IO, Any

import torch

from fp8state._te.hash_scan import check_file_hash_cost
from fp8state._te.sniff import describe_te_value
from fp8state.checkpoint._entries import iter_extra_states
from fp8state.errors import CheckpointError, LegacyFormatError, UnsafeCheckpointError

__all__ = ["load", "find_legacy_extra_states", "refused_global"]

_MIGRATE_FIX = (
    "Convert it once with `fp8state migrate IN OUT` (or fp8state.migrate.load_te_checkpoint"
    "(path) in Python), then load the converted file."
)
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def find_legacy_extra_states(obj: object) -> dict[str, str]:
    """Return ``{key: description}`` of every TransformerEngine-style ``_extra_state`` in ``obj``.

    Only forms TransformerEngine wrote are reported (pickled uint8 tensors, lists, dicts of
    ``scale_fwd``..., ``None``); another library's extra state is left alone.

    Example:
        >>> import torch, fp8state
        >>> from fp8state.checkpoint import find_legacy_extra_states
        >>> state = {"fc.weight": torch.ones(2, 2), "fc._extra_state": None}  # TE <= 0.5
        >>> find_legacy_extra_states(state)
        {'fc._extra_state': 'None (TransformerEngine <= 0.5, FP8 never used)'}
        >>> find_legacy_extra_states(fp8state.Linear(16, 16).state_dict())
        {}
    """
    found = {}
    for key, value in iter_extra_states(obj):
        era = describe_te_value(value)
        if era is not None:
            found[key] = era
    return found


def refused_global(err: BaseException) -> str | None:
    """The global torch's weights-only unpickler refused (``"argparse.Namespace"``), or None.

    torch's message is many lines of advice; fp8state's one-line errors quote only the name.
    """
    match = _GLOBAL.search(str(err))
    return match.group(1) if match else None


def _describe(path: object) -> str:
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else f"<{type(path).__name__}>"


def _unpickling_error(where: str, err: pickle.UnpicklingError) -> Exception:
    name = refused_global(err)
    if name is None:
        return CheckpointError(
            where,
            f"a file the weights-only unpickler cannot read ({str(err).splitlines()[0]})",
            "a torch.save file of tensors and plain containers",
            "The file is corrupt or was not written by torch.save.",
        )
    if name in ("_io.BytesIO", "io.BytesIO"):
        return LegacyFormatError(
            where,
            "io.BytesIO extra states (a TransformerEngine 0.12-1.13 checkpoint)",
            "an fp8state checkpoint (tensors only)",
            _MIGRATE_FIX,
        )
    return UnsafeCheckpointError(
        where,
        f"a pickled reference to the Python global {name}",
        "tensors and plain containers only (fp8state never pickles objects)",
        "Nothing was executed. If this is a TransformerEngine checkpoint, convert it with "
        "`fp8state migrate IN OUT`; otherwise only torch.load(weights_only=False) reads it, "
        "which runs code from the file: do that only if you trust its source.",
    )


def _check_pickle_hashing(path: str | os.PathLike[str] | IO[bytes], where: str) -> None:
    """Refuse a file whose pickle would make ``torch.load`` hash without end.

    torch's weights-only reader hashes every dict key a pickle builds; a key can be made to
    cost 2**48 steps in a few bytes. The pickle is dry-run first (``fp8state._te.hash_scan``).
    """
    try:
        check_file_hash_cost(path, where)
    except LegacyFormatError as err:
        raise CheckpointError(where, err.found, err.expected, err.fix) from None
    except OSError:
        return  # missing or unreadable: torch.load reports it as it always has


def load(path: str | os.PathLike[str] | IO[bytes], map_location: Any = "cpu") -> Any:
    """Load a checkpoint written with ``torch.save``, never executing code from it.

    Args:
        path: A file path or a binary file object.
        map_location: Where tensors go, as in ``torch.load``. The default ``"cpu"`` keeps
            loading off every GPU: ``fp8state.checkpoint.load_state_dict`` (or
            ``model.load_state_dict``) then copies each tensor onto its module's device.
            ``None`` restores tensors where they were saved, which allocates on the saving
            GPU (PyTorch's rule); fp8state's own extra state is on the CPU either way.

    Returns:
        What was saved (usually a state dict).

    Raises:
        LegacyFormatError: a TransformerEngine checkpoint; the message points at
            ``fp8state migrate``.
        UnsafeCheckpointError: the pickle references a Python global outside torch's
            weights-only allow-list; nothing was run.
        CheckpointError: a corrupt or truncated file, a distributed-checkpoint folder, or a
            tensor saved on a device this machine lacks (with ``map_location=None``).
        FileNotFoundError: ``path`` does not exist.

    Example:
        >>> import io, torch, fp8state
        >>> buf = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buf)
        >>> _ = buf.seek(0)
        >>> fp8state.checkpoint.load(buf)["w"].device
        device(type='cpu')
    """
    where = _describe(path)
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        from fp8state.checkpoint.dcp_files import is_dcp_checkpoint

        if is_dcp_checkpoint(path):
            raise CheckpointError(
                where,
                "a torch.distributed.checkpoint (DCP) folder",
                "a torch.save file",
                "Load it into a model with fp8state.checkpoint.dcp_load(model, path), read it "
                "with fp8state.checkpoint.load_dcp_state_dict(path), or convert it with "
                "`fp8state consolidate DIR OUT`.",
            )
        raise CheckpointError(
            where, "a folder", "a torch.save file", "Pass the checkpoint file inside it."
        )
    _check_pickle_hashing(path, where)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise _unpickling_error(where, err) from err
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        # torch reports a damaged archive as RuntimeError, OSError (EINVAL) or EOFError.
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "CUDA device" in first:
            fix = "Leave map_location at its default 'cpu', or name a device this machine has."
        else:
            fix = "The file is truncated or corrupt; save it again or use an earlier copy."
        raise CheckpointError(
            where, f"an unreadable file ({first})", "a torch.save file", fix
        ) from err
    legacy = find_legacy_extra_states(obj)
    if legacy:
        first_key, era = next(iter(legacy.items()))
        more = f" and {len(legacy) - 1} more" if len(legacy) > 1 else ""
        raise LegacyFormatError(
            f"{where}: {first_key}{more}",
            f"TransformerEngine extra state: {era}",
            "fp8state extra state (a dict of tensors with a schema_version)",
            _MIGRATE_FIX,
        )
    return obj
