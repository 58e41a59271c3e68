"""safetensors files of plain weights: :func:`to_plain_state_dict` and back, one call each.

safetensors is optional (``pip install fp8state[safetensors]``); it is imported on first use.
The weights file is what an ``nn.Linear``-based model (or ``transformers``, which wants the
header's ``format`` to be ``"pt"``) loads; the FP8 metadata, when kept, goes to a second file,
so the weights file never holds a key the plain model lacks. Tied weights follow
safetensors' own convention: one name per shared tensor, as ``safetensors.torch.save_model``
writes and ``safetensors.torch.load_model`` reads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fp8state.checkpoint._entries import model_entries
from fp8state.checkpoint._plain_names import plain_keys
from fp8state.checkpoint._ties import shared_tensor_names
from fp8state.checkpoint.plain import (
    load_plain_state_dict,
    split_metadata_key,
    to_plain_state_dict,
)
from fp8state.checkpoint.safetensors_files import (
    FP8_METADATA_MARK,
    holds_fp8_metadata,
    is_fp8_metadata_header,
    safetensors_header,
)
from fp8state.errors import CheckpointError
from fp8state.schema import SCHEMA_VERSION

__all__ = ["save_safetensors", "load_safetensors"]

PathLike = str | os.PathLike[str]


def _safetensors_torch() -> ModuleType:
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError(
            "safetensors",
            "the package is not installed",
            "safetensors>=0.4",
            "Install it with `pip install fp8state[safetensors]` (or `pip install safetensors`).",
        ) from None
    return safetensors.torch


def _output_paths(path: PathLike, fp8_metadata_path: PathLike | None) -> tuple[str, str | None]:
    out = os.fspath(path)
    meta = None if fp8_metadata_path is None else os.fspath(fp8_metadata_path)
    for argument, value in (("path", out), ("fp8_metadata_path", meta)):
        if value is not None and os.path.isdir(value):
            raise CheckpointError(
                value,
                "a folder",
                f"a file name as {argument}",
                "Pass the path of the .safetensors file to write, e.g. "
                f"{os.path.join(value, 'model.safetensors')!r}.",
            )
    if meta is not None and os.path.abspath(meta) == os.path.abspath(out):
        raise CheckpointError(
            meta,
            "the same file as path",
            "a second file for the FP8 metadata",
            "Pass another name, e.g. fp8_metadata_path='fp8_metadata.safetensors'.",
        )
    return out, meta


def save_safetensors(
    model: nn.Module, path: PathLike, *, fp8_metadata_path: PathLike | None = None
) -> None:
    """Write the model's plain weights to ``path``, its FP8 metadata to ``fp8_metadata_path``.

    1. The weights are :func:`~fp8state.checkpoint.to_plain_state_dict`'s, under the names
       of the ``nn.Linear``-based model, with the header ``{"format": "pt"}``.
    2. A tensor the model holds under several keys (tied weights) is written once, under the
       alphabetically first of them, and the header maps each dropped name to the kept one:
       ``safetensors.torch.save_model``'s convention, so ``safetensors.torch.load_model``
       loads the file into the plain model, and :func:`load_safetensors` fills the dropped
       keys through the tie.
    3. The FP8 metadata (keys ``"<module>._extra_state.<schema key>"``) goes to a second
       file, whose header holds ``fp8state_schema_version``; without ``fp8_metadata_path``
       it is dropped.

    Args:
        model: The model (see :func:`~fp8state.checkpoint.to_plain_state_dict`).
        path: The weights file.
        fp8_metadata_path: Where to write the FP8 metadata; None drops it.

    Raises:
        CheckpointError: safetensors is not installed, a path is a folder (or both are the
            same file), or a value cannot be exported. Nothing was written.

    Example:
        >>> import os, tempfile, torch, fp8state, safetensors.torch
        >>> from fp8state.checkpoint import save_safetensors
        >>> folder = tempfile.mkdtemp()
        >>> model = torch.nn.Sequential(fp8state.Linear(16, 16))
        >>> save_safetensors(model, os.path.join(folder, "model.safetensors"),
        ...                  fp8_metadata_path=os.path.join(folder, "fp8.safetensors"))
        >>> sorted(safetensors.torch.load_file(os.path.join(folder, "model.safetensors")))
        ['0.bias', '0.weight']
        >>> len(safetensors.torch.load_file(os.path.join(folder, "fp8.safetensors")))
        11
    """
    st = _safetensors_torch()
    out, meta_out = _output_paths(path, fp8_metadata_path)
    entries = model_entries(model)
    shared = shared_tensor_names(entries, plain_keys(entries))
    if meta_out is None:
        weights = to_plain_state_dict(model)
        metadata: dict[str, torch.Tensor] = {}
    else:
        weights, metadata = to_plain_state_dict(model, fp8_metadata="separate")
    header = {"format": "pt"}
    for kept, dropped in shared.items():
        for name in dropped:
            if kept in weights and weights.pop(name, None) is not None:
                header[name] = kept  # as save_model records it
    if meta_out is not None:
        st.save_file(
            metadata, meta_out, metadata={"format": "pt", FP8_METADATA_MARK: str(SCHEMA_VERSION)}
        )
    st.save_file(weights, out, metadata=header)


def _load_file(st: ModuleType, path: str) -> dict[str, torch.Tensor]:
    try:
        loaded: dict[str, torch.Tensor] = st.load_file(path, device="cpu")
    except Exception as err:  # noqa: BLE001 - safetensors' errors share no base but Exception
        raise CheckpointError(
            path,
            f"a safetensors file that cannot be read ({type(err).__name__}: {err})",
            "a complete .safetensors file",
            "The file is truncated or damaged; copy it again from its source.",
        ) from None
    return loaded


def _read_weights(st: ModuleType, paths: Sequence[str]) -> dict[str, torch.Tensor]:
    for path in paths:  # every file checked before any is read
        if is_fp8_metadata_header(safetensors_header(path, "path")):
            raise CheckpointError(
                path,
                f"the FP8 metadata file save_safetensors writes ({FP8_METADATA_MARK} "
                "in its header)",
                "a weights file as path",
                f"Pass it as fp8_metadata_path={path!r}, and the weights file as path.",
            )
    merged: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for path in paths:
        for key, value in _load_file(st, path).items():
            if key in merged:
                raise CheckpointError(
                    key,
                    f"the key in both {origin[key]} and {path}",
                    "each key in one file",
                    "Pass the shards of one checkpoint, each once.",
                )
            merged[key] = value
            origin[key] = path
    return merged


def _read_fp8_metadata(st: ModuleType, path: str) -> dict[str, torch.Tensor]:
    header = safetensors_header(path, "fp8_metadata_path")
    keys = [k for k in header if k != "__metadata__"]
    if keys and not holds_fp8_metadata(header):
        raise CheckpointError(
            path,
            f"a file of {len(keys)} tensors, none of them FP8 metadata (a weights file?)",
            "the FP8 metadata file save_safetensors wrote, keys "
            "'<module>._extra_state.<schema key>'",
            f"Pass it as path={path!r}; pass fp8_metadata_path only for the FP8 metadata "
            "file, or leave it out to start every FP8 module fresh.",
        )
    return _load_file(st, path)


def read_fp8_metadata_file(path: PathLike) -> dict[str, dict[str, torch.Tensor]]:
    """The FP8 metadata file :func:`save_safetensors` wrote, as ``{extra-state key: payload}``.

    Raises:
        CheckpointError: safetensors is not installed, ``path`` is not such a file, or a key
            lacks the ``<module>._extra_state.`` part.
    """
    flat = _read_fp8_metadata(_safetensors_torch(), os.fspath(path))
    payloads: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        parts = split_metadata_key(key)
        if parts is None:
            raise CheckpointError(
                key,
                "a key without a '<module>._extra_state.' part",
                "'<module name>._extra_state.<schema key>'",
                f"{os.fspath(path)} is not an FP8 metadata file save_safetensors wrote.",
            )
        module_key, field = parts
        payloads.setdefault(module_key, {})[field] = value
    return payloads


def load_safetensors(
    model: nn.Module,
    path: PathLike | Sequence[PathLike],
    strict: bool = True,
    *,
    fp8_metadata_path: PathLike | None = None,
    assign: bool = False,
) -> Any:
    """Load plain weights from safetensors file(s) with :func:`load_plain_state_dict`.

    Every file is checked before any is read: a folder, a JSON index, a ``torch.save``
    file, or the FP8 metadata file passed as ``path`` is a :class:`CheckpointError` saying
    what to pass instead. A key the files lack for a tied weight (safetensors files keep one
    name per shared tensor) is filled through the tie.

    Args:
        model: The model with fp8state modules.
        path: A weights file, or the shards of one (a Hugging Face ``model-0000i-of-0000n``
            set); a key in two shards is an error.
        strict: As in :func:`~fp8state.checkpoint.load_plain_state_dict`.
        fp8_metadata_path: The FP8 metadata file :func:`save_safetensors` wrote, or None to
            start every FP8 module fresh.
        assign: As in ``nn.Module.load_state_dict``.

    Returns:
        ``load_state_dict``'s named tuple of missing and unexpected keys.

    Raises:
        CheckpointError: safetensors is not installed, a path is not a safetensors file of
            the expected kind, a key is in two shards, or (as a
            :class:`~fp8state.checkpoint.StateDictError`) the weights do not fit the model;
            the model is then unchanged.

    Example:
        Weights of a plain ``nn.Linear`` model, as Hugging Face files hold them:

        >>> import os, tempfile, torch, fp8state, safetensors.torch
        >>> from fp8state.checkpoint import load_safetensors
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> plain = torch.nn.Sequential(torch.nn.Linear(16, 16))
        >>> safetensors.torch.save_file(plain.state_dict(), path)
        >>> model = torch.nn.Sequential(fp8state.Linear(16, 16))
        >>> load_safetensors(model, path)  # FP8 metadata starts fresh
        <All keys matched successfully>
        >>> torch.equal(model[0].weight, plain[0].weight)
        True
    """
    st = _safetensors_torch()
    paths = [path] if isinstance(path, str | os.PathLike) else list(path)
    if not paths:
        raise CheckpointError(
            "path",
            "an empty list of files",
            "a .safetensors file, or the shards of one",
            "Pass the weights file(s).",
        )
    files = [os.fspath(p) for p in paths]
    metadata = (
        None if fp8_metadata_path is None else _read_fp8_metadata(st, os.fspath(fp8_metadata_path))
    )
    return load_plain_state_dict(
        model, _read_weights(st, files), strict, assign=assign, fp8_metadata=metadata
    )
