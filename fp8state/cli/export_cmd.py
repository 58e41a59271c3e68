"""``fp8state export SRC OUT_DIR``: an FP8-trained checkpoint as an FP8 inference folder.

SRC is a Hugging Face folder saved from an fp8state model (``save_pretrained``), a
``torch.save`` state dict or a DCP folder; the model's ``config.json`` (SRC's own, or
``--config``'s) tells which layers are ``nn.Linear``. Writes compressed-tensors' per-tensor
static FP8 format (docs/export.md).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from fp8state.checkpoint import load, load_dcp_state_dict
from fp8state.checkpoint.dcp_files import is_dcp_checkpoint
from fp8state.cli._paths import existing_path
from fp8state.cli._terminal import say
from fp8state.errors import ExportError
from fp8state.export import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    architecture,
    export_state_dict,
    unreadable,
    weight_files,
)

NAME = "export"
HELP = (
    "Write an FP8-trained checkpoint (a Hugging Face folder, a torch.save state dict or a DCP "
    "folder) as an FP8 inference folder in compressed-tensors' per-tensor static format."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``SRC``, ``OUT_DIR`` and the options."""
    parser.add_argument("src", metavar="SRC", help="HF folder, torch.save file or DCP folder")
    parser.add_argument("out", metavar="OUT_DIR", help="the folder to write")
    parser.add_argument("--config", metavar="HF_DIR", help="folder with the model's config.json")
    parser.add_argument("--window", type=int, help="steps of amax history for input scales")
    parser.add_argument("--percentile", type=float, help="input amax as this percentile")
    parser.add_argument("--exclude", action="append", default=[], help="module to leave out")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="past this size, weights go into shards with an index (default: 5 GB)",
    )


def _read(src: str) -> Any:
    if os.path.isdir(src) and os.path.isfile(os.path.join(src, CONFIG_FILE)):
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for path in weight_files(src):  # by the index of a sharded folder
            try:
                state.update(load_file(path))
            except Exception as err:  # safetensors reports damage as its own error types
                raise unreadable(path, err, "save_pretrained") from None
        return state
    if is_dcp_checkpoint(src):
        return load_dcp_state_dict(src)
    return load(src)


def run(args: argparse.Namespace) -> int:
    """Read SRC, export, print what was written, return 0."""
    existing_path(args.src, "a Hugging Face folder, a torch.save file or a DCP folder")
    config_dir = args.config or args.src
    if not os.path.isfile(os.path.join(config_dir, CONFIG_FILE)):
        raise ExportError(
            args.src,
            f"no {CONFIG_FILE} beside it",
            "the model's config.json, which says which layers are nn.Linear",
            "Pass --config with the Hugging Face folder of the model.",
        )
    state = _read(args.src)
    if not isinstance(state, dict):
        raise ExportError(
            args.src,
            f"a {type(state).__name__}",
            "a state dict",
            "Save the model's state_dict() (or use save_pretrained), then export that.",
        )
    config_path = os.path.join(config_dir, CONFIG_FILE)
    try:
        with open(config_path) as file:
            config = json.load(file)
    except ValueError as err:
        raise ExportError(
            config_path, f"invalid JSON ({err})", "the model's config.json", "Fix the file."
        ) from None
    report = export_state_dict(
        state,
        args.out,
        config=config,
        architecture=architecture(config_dir),
        copy_from=config_dir,
        window=args.window,
        percentile=args.percentile,
        exclude=args.exclude,
        overwrite=args.overwrite,
        max_shard_bytes=args.max_shard_bytes,
    )
    say(
        f"wrote {report.out_dir}: {len(report.scales)} FP8 layers, "
        f"{len(report.ignored)} modules in the training dtype"
        + (f", {len(report.kept)} FP8 modules not converted" if report.kept else "")
    )
    return 0
