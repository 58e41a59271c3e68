"""The weight files of an export: one ``model.safetensors``, or shards with an index.

Hugging Face's layout: past ``max_shard_bytes`` the tensors go, in order, into
``model-00001-of-0000N.safetensors`` files, and ``model.safetensors.index.json`` maps each
tensor name to its file (``{"metadata": {"total_size": ...}, "weight_map": {...}}``), which
transformers, compressed-tensors and vLLM read.
"""

from __future__ import annotations

import json
import os

import torch

from fp8state.errors import ExportError

__all__ = [
    "WEIGHTS_FILE",
    "INDEX_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "split",
    "weight_files",
    "unreadable",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Hugging Face's default shard size ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def split(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> tuple[dict[str, dict[str, torch.Tensor]], dict | None]:
    """``{file name: tensors}`` and the index to write (None for one file).

    A tensor larger than ``max_shard_bytes`` gets a shard of its own.
    """
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += nbytes
    if len(shards) == 1:
        return {WEIGHTS_FILE: shards[0]}, None
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    files = dict(zip(names, shards, strict=True))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    weight_map = {key: name for name, shard in files.items() for key in shard}
    return files, {"metadata": {"total_size": total}, "weight_map": weight_map}


def weight_files(folder: str) -> list[str]:
    """The weight files of an export folder, by the index if there is one.

    Raises:
        ExportError: neither ``model.safetensors`` nor a readable index, or an index naming
            a file outside the folder.
    """
    index = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(index):
        if os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
            return [os.path.join(folder, WEIGHTS_FILE)]
        raise ExportError(
            folder, f"no {WEIGHTS_FILE} and no {INDEX_FILE}", "an export's weights", "Export again."
        )
    try:
        with open(index) as file:
            names = set(json.load(file)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ExportError(
            index,
            f"an unreadable index ({type(err).__name__})",
            "Hugging Face's safetensors index",
            "Export again.",
        ) from None
    for name in names:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ExportError(
                index,
                "a weight file outside the folder",
                "file names inside the folder",
                "Export again.",
            )
    return [os.path.join(folder, name) for name in sorted(names)]


def unreadable(path: str, err: BaseException, written_by: str) -> ExportError:
    """The error for a weight file safetensors cannot read (it raises its own error types)."""
    return ExportError(
        path,
        f"an unreadable safetensors file ({type(err).__name__})",
        f"the weights {written_by} wrote",
        "The folder is damaged or incomplete; copy or write it again.",
    )
