"""safetensors files of plain weights: :func:`to_plain_state_dict` and back, one call each.

safetensors is optional (``pip install fp8state[safetensors]``); it is imported on first use.
The weights file is what an ``nn.Linear``-based model (or ``transformers``, which wants the
header's ``format`` to be ``"pt"``) loads; the FP8 metadata, when kept, goes to a second file,
so the weights file never holds a key the plain model lacks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fp8state.checkpoint.plain import load_plain_state_dict, to_plain_state_dict
from fp8state.errors import CheckpointError
from fp8state.schema import SCHEMA_VERSION

__all__ = ["save_safetensors", "load_safetensors"]

PathLike = str | os.PathLike[str]


def _safetensors_torch() -> ModuleType:
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError(
            "safetensors", "the package is not installed", "safetensors>=0.4",
            "Install it with `pip install fp8state[safetensors]` (or `pip install "
            "safetensors`).",
        ) from None
    return safetensors.torch


def save_safetensors(
    model: nn.Module, path: PathLike, *, metadata_path: PathLike | None = None
) -> None:
    """Write the model's plain weights to ``path``, its FP8 metadata to ``metadata_path``.

    Args:
        model: The model (see :func:`~fp8state.checkpoint.to_plain_state_dict`).
        path: The weights file; its keys are the ``nn.Linear``-based model's.
        metadata_path: Where to write the FP8 metadata map (keys
            ``"<module>._extra_state.<schema key>"``); None drops the metadata.

    Raises:
        CheckpointError: safetensors is not installed, or a value cannot be exported.

    Example:
        >>> import os, tempfile, torch, fp8state, safetensors.torch
        >>> from fp8state.checkpoint import save_safetensors
        >>> folder = tempfile.mkdtemp()
        >>> model = torch.nn.Sequential(fp8state.Linear(16, 16))
        >>> save_safetensors(model, os.path.join(folder, "model.safetensors"),
        ...                  metadata_path=os.path.join(folder, "fp8.safetensors"))
        >>> sorted(safetensors.torch.load_file(os.path.join(folder, "model.safetensors")))
        ['0.bias', '0.weight']
        >>> len(safetensors.torch.load_file(os.path.join(folder, "fp8.safetensors")))
        11
    """
    st = _safetensors_torch()
    if metadata_path is None:
        weights = to_plain_state_dict(model)
    else:
        weights, metadata = to_plain_state_dict(model, fp8_metadata="separate")
        st.save_file(metadata, os.fspath(metadata_path),
                     metadata={"format": "pt", "fp8state_schema_version": str(SCHEMA_VERSION)})
    st.save_file(weights, os.fspath(path), metadata={"format": "pt"})


def _read(st: ModuleType, paths: Sequence[PathLike]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for path in paths:
        for key, value in st.load_file(os.fspath(path), device="cpu").items():
            if key in merged:
                raise CheckpointError(
                    key, f"the key in both {origin[key]} and {os.fspath(path)}",
                    "each key in one file", "Pass the shards of one checkpoint, each once.",
                )
            merged[key] = value
            origin[key] = os.fspath(path)
    return merged


def load_safetensors(
    model: nn.Module,
    path: PathLike | Sequence[PathLike],
    *,
    metadata_path: PathLike | None = None,
    strict: bool = True,
    assign: bool = False,
) -> Any:
    """Load plain weights from safetensors file(s) with :func:`load_plain_state_dict`.

    Args:
        model: The model with fp8state modules.
        path: A weights file, or the shards of one (a Hugging Face ``model-0000i-of-0000n``
            set); a key in two shards is an error.
        metadata_path: The FP8 metadata file :func:`save_safetensors` wrote, or None to
            start every FP8 module fresh.
        strict: As in :func:`~fp8state.checkpoint.load_plain_state_dict`.
        assign: As in ``nn.Module.load_state_dict``.

    Returns:
        ``load_state_dict``'s named tuple of missing and unexpected keys.

    Raises:
        CheckpointError: safetensors is not installed, a key is in two shards, or (as a
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
    metadata = None if metadata_path is None else _read(st, [metadata_path])
    return load_plain_state_dict(
        model, _read(st, paths), strict=strict, assign=assign, fp8_metadata=metadata
    )
