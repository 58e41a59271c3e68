"""Write an export folder whole or not at all: a temporary folder beside it, renamed at the end.

An existing folder is replaced only when asked (``overwrite``): the new folder is complete
before the old one is moved aside, and the old one is removed only after the rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable
from typing import Any

import torch

from fp8state.errors import ExportError
from fp8state.export._shards import INDEX_FILE, split

__all__ = ["CONFIG_FILE", "COPIED_FILES", "check_target", "write_folder"]

CONFIG_FILE = "config.json"
#: Files a serving stack reads beside the weights, copied from the source folder when present.
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def check_target(out_dir: str, overwrite: bool) -> None:
    """Refuse ``out_dir`` before any work: no parent folder, or existing without overwrite."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(out_dir))):
        raise ExportError(
            out_dir, "no parent folder", "a path inside an existing folder", "Create it first."
        )
    if os.path.lexists(out_dir) and not (overwrite and os.path.isdir(out_dir)):
        raise ExportError(
            out_dir,
            "an existing " + ("folder" if os.path.isdir(out_dir) else "file"),
            "a path that does not exist yet",
            "Pick a new folder, or pass overwrite=True (CLI: --overwrite) to replace a folder.",
        )


def write_folder(
    out_dir: str,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    copy_from: Iterable[str],
    overwrite: bool,
    max_shard_bytes: int,
) -> None:
    """Write ``config.json``, the weight files and the copied files as ``out_dir``.

    Args:
        out_dir: The folder to create (or replace, with ``overwrite``).
        tensors: What the weight files hold.
        config: What ``config.json`` holds.
        copy_from: Files to copy in (the source folder's tokenizer and generation files).
        overwrite: Replace an existing folder.
        max_shard_bytes: Past this size the weights go into shards with an index.

    The callers refuse an existing ``out_dir`` (:func:`check_target`) before any work; the
    final rename checks again, for a folder that appeared meanwhile.
    """
    from safetensors.torch import save_file

    parent, name = os.path.split(os.path.abspath(out_dir))
    try:  # before any byte is written: a config json cannot hold fails here
        config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as err:
        raise ExportError(
            "config",
            f"a value JSON cannot hold ({err})",
            "a JSON-serializable config",
            "Pass the config as plain data (PretrainedConfig.to_dict()).",
        ) from None
    tmp = os.path.join(parent, f".{name}.{secrets.token_hex(4)}.tmp")
    os.mkdir(tmp)
    try:
        files, index = split(_unshared(tensors), max_shard_bytes)
        for file_name, shard in files.items():
            save_file(shard, os.path.join(tmp, file_name), metadata={"format": "pt"})
        if index is not None:
            with open(os.path.join(tmp, INDEX_FILE), "w") as file:
                json.dump(index, file, indent=2, sort_keys=True)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as file:
            file.write(config_text)
        for path in copy_from:
            shutil.copy2(path, os.path.join(tmp, os.path.basename(path)))
        _publish(tmp, os.path.abspath(out_dir), overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two sharing storage (safetensors refuses shared memory)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in tensors.items():
        cpu = value.detach().to("cpu").contiguous()
        storage = cpu.untyped_storage().data_ptr()
        out[key] = cpu.clone() if storage in seen and cpu.numel() else cpu
        seen.add(storage)
    return out


def _publish(tmp: str, out_dir: str, overwrite: bool) -> None:
    if not os.path.lexists(out_dir):
        # A non-empty folder that appeared meanwhile makes this fail; an empty one is replaced.
        os.rename(tmp, out_dir)
        return
    check_target(out_dir, overwrite)
    old = f"{tmp}.old"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    with contextlib.suppress(OSError):
        shutil.rmtree(old)
