"""Turn a DCP checkpoint folder into one ``torch.save`` file any PyTorch can read.

The result holds the state dict as it was saved (fp8state extra states as flat dicts of CPU
tensors, sharded parameters whole), is read by plain ``torch.load(weights_only=True)``, and
loads into a model on one device with ``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import torch

from fp8state._atomic_file import write_atomically
from fp8state._walk import walk
from fp8state.checkpoint._entries import iter_extra_states
from fp8state.checkpoint._problems import keys_of, summarize
from fp8state.checkpoint.dcp_files import load_dcp_state_dict
from fp8state.checkpoint.io import refused_global
from fp8state.errors import CheckpointError, FP8StateError, StateDictError
from fp8state.schema import is_payload, unpack

__all__ = ["ConsolidateResult", "consolidate"]


@dataclass(frozen=True)
class ConsolidateResult:
    """What :func:`consolidate` wrote.

    Attributes:
        path: The file written.
        num_tensors: Tensors in it, counting those inside extra states.
        num_bytes: Bytes of tensor data.
        fp8_modules: Keys of the fp8state extra states in it (all validated).
    """

    path: str
    num_tensors: int
    num_bytes: int
    fp8_modules: tuple[str, ...]


def _tensors(obj: object) -> list[torch.Tensor]:
    return [value for _, value in walk(obj) if isinstance(value, torch.Tensor)]


def _exists(out: str) -> CheckpointError:
    return CheckpointError(
        out,
        "an existing file",
        "a path that does not exist yet",
        "Choose another output path, or pass overwrite=True to replace it.",
    )


def _write(state: object, out: str, num_tensors: int, source: str, overwrite: bool) -> None:
    """``torch.save(state, out)`` atomically, read back with ``weights_only=True`` first."""
    try:
        write_atomically(
            out,
            lambda file: torch.save(state, file),
            check=lambda tmp: _check_readable(tmp, out, num_tensors, source),
            overwrite=overwrite,
        )
    except FileExistsError:  # also one that appeared while the file was written
        raise _exists(out) from None


def _check_readable(tmp: str, out: str, num_tensors: int, source: str) -> None:
    """Read ``tmp`` back as every user will: a file weights_only cannot read is not written."""
    try:
        back = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        what = refused_global(err) or str(err).splitlines()[0]
        raise CheckpointError(
            source,
            f"items torch.load(weights_only=True) refuses ({what})",
            "tensors and plain containers only",
            "Nothing was written. The checkpoint holds pickled Python objects besides the "
            "model (e.g. a custom optimizer state); save those separately.",
        ) from err
    if len(_tensors(back)) != num_tensors:
        raise CheckpointError(
            out,
            f"{len(_tensors(back))} tensors read back",
            f"{num_tensors} tensors",
            "The disk may be full or failing; check it and run consolidate again.",
        )


def consolidate(
    dcp_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    trusted: bool = False,
) -> ConsolidateResult:
    """Write the DCP checkpoint in ``dcp_dir`` as one ``torch.save`` file at ``out_path``.

    Runs in one process, with or without a process group (call it on one rank only: the
    whole checkpoint is held in host memory).

    1. Every item is read onto the CPU and nested dicts are rebuilt.
    2. Every fp8state extra state is validated; a problem stops here, before any write.
    3. The file is written next to ``out_path``, read back with ``torch.load(weights_only=
       True)`` and only then renamed into place, so ``out_path`` is never half-written.

    Args:
        dcp_dir: The DCP checkpoint folder.
        out_path: The file to write.
        overwrite: Replace an existing ``out_path``.
        trusted: Read the folder with DCP's own reader (plain pickle); by default nothing
            pickled in it runs (:func:`load_dcp_state_dict`'s ``trusted``).

    Returns:
        A :class:`ConsolidateResult` describing the file.

    Raises:
        CheckpointError: ``dcp_dir`` is not a readable DCP checkpoint, or ``out_path`` exists
            and ``overwrite`` is False.
        StateDictError: some extra state is invalid (all are listed); nothing was written.

    Example:
        >>> import os, tempfile, torch, torch.distributed.checkpoint as dcp, fp8state
        >>> class One(fp8state.FP8StateMixin):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.ones(2, 2))
        ...         self.init_fp8_meta(num_gemms=1, history_rows=4)
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp.save(One().state_dict(), checkpoint_id=folder, no_dist=True)
        >>> out = os.path.join(folder, "one.pt")
        >>> fp8state.checkpoint.consolidate(folder, out).fp8_modules
        ('_extra_state',)
        >>> One().load_state_dict(torch.load(out, weights_only=True))
        <All keys matched successfully>
    """
    out = os.fspath(out_path)
    if os.path.lexists(out) and not overwrite:
        raise _exists(out)
    state = load_dcp_state_dict(dcp_dir, trusted=trusted)
    fp8_keys: list[str] = []
    problems: list[FP8StateError] = []
    for key, value in iter_extra_states(state):
        if not is_payload(value):
            continue
        fp8_keys.append(key)
        try:
            unpack(value)
        except FP8StateError as err:
            problems.append(err.under(key))
    if problems:
        raise StateDictError(
            keys_of(problems),
            summarize(problems),
            "valid fp8state extra states",
            "Nothing was written. The checkpoint is damaged; consolidate an earlier one.",
            problems,
        )
    tensors = _tensors(state)
    _write(state, out, len(tensors), os.fspath(dcp_dir), overwrite)
    return ConsolidateResult(
        path=out,
        num_tensors=len(tensors),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors),
        fp8_modules=tuple(fp8_keys),
    )
