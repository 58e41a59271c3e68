"""``fp8state inspect PATH [--json]``: the FP8 modules of any checkpoint, one row each.

Works for fp8state checkpoints and TransformerEngine checkpoints of every era, as one
``torch.save`` file or a ``torch.distributed.checkpoint`` (DCP) folder, and for the FP8
metadata file ``save_safetensors(..., fp8_metadata_path=)`` writes. Everything is read
through allow-lists (safetensors holds no pickle), onto the CPU, and nothing pickled in it runs.
"""

from __future__ import annotations

import argparse
import io
import json
import os

import torch

from fp8state.checkpoint.plain_safetensors import read_fp8_metadata_file
from fp8state.checkpoint.safetensors_files import holds_fp8_metadata, read_header
from fp8state.cli._paths import existing_path
from fp8state.cli._terminal import say
from fp8state.errors import CheckpointError
from fp8state.export import describe_export, read_export
from fp8state.migrate.summary import CheckpointSummary, summarize_checkpoint

NAME = "inspect"
HELP = (
    "Show each FP8 module of a checkpoint (fp8state or TransformerEngine, any era; a torch.save "
    "file, a DCP folder, or an FP8 metadata .safetensors file): era, slots, history length, "
    "scale and amax ranges, recipe, and the devices its tensors were saved on; or the FP8 "
    "layers and scales of a folder fp8state export wrote."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``PATH`` and ``--json``."""
    parser.add_argument(
        "path",
        metavar="PATH",
        help="a torch.save file, a folder written by torch.distributed.checkpoint, or the FP8 "
        "metadata .safetensors file fp8state's save_safetensors writes",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON); errors propagate to the CLI's one-line handler."""
    existing_path(args.path, "a torch.save file, a DCP folder or an FP8 metadata .safetensors file")
    quant = read_export(args.path) if os.path.isdir(args.path) else None
    if quant is not None:  # a folder fp8state export wrote
        described = describe_export(args.path, quant)
        if args.json:
            print(json.dumps(described, indent=2))
        else:
            say(*_export_lines(args.path, described))
        return 0
    summary = _summarize(args.path)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))  # escapes control characters itself
    else:
        say(*summary.table_lines())
    return 0


def _export_lines(path: str, described: dict) -> list[str]:
    lines = [f"{path}: {described['format']} FP8 export, {len(described['layers'])} FP8 layers"]
    lines.append(f"{'layer':<48} {'shape':>14} {'weight_scale':>13} {'input_scale':>13}")
    for name, layer in described["layers"].items():
        shape = "x".join(map(str, layer["shape"]))
        lines.append(
            f"{name:<48} {shape:>14} {layer['weight_scale']:>13.6g} {layer['input_scale']:>13.6g}"
        )
    lines.append(f"in the training dtype (ignore): {', '.join(described['ignore']) or 'none'}")
    return lines


def _summarize(path: str) -> CheckpointSummary:
    """Summarize a checkpoint; a safetensors file is told apart by its header first."""
    header = read_header(path) if os.path.isfile(path) else None
    if header is None:
        return summarize_checkpoint(path)
    tensors = len([k for k in header if k != "__metadata__"])
    if not holds_fp8_metadata(header):
        raise CheckpointError(
            path,
            f"a safetensors file of {tensors} plain tensors (no FP8 metadata in it)",
            "a torch.save checkpoint, a DCP folder, or the FP8 metadata file "
            "save_safetensors(..., fp8_metadata_path=) writes",
            "A weights file holds no FP8 state to show; inspect the FP8 metadata file written "
            "beside it, if there is one.",
        )
    # Regroup the flat map into extra states and summarize that, as for a torch.save file.
    buffer = io.BytesIO()
    torch.save(read_fp8_metadata_file(path), buffer)
    buffer.seek(0)
    buffer.name = path  # what the summary calls its source
    return summarize_checkpoint(buffer)
