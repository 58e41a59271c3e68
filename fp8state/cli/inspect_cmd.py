"""``fp8state inspect PATH [--json]``: the FP8 modules of any checkpoint, one row each.

Works for fp8state checkpoints and TransformerEngine checkpoints of every era, as one
``torch.save`` file or a ``torch.distributed.checkpoint`` (DCP) folder. Everything is read
through allow-lists, onto the CPU, and nothing pickled in it runs.
"""

from __future__ import annotations

import argparse
import json

from fp8state.migrate.summary import summarize_checkpoint

NAME = "inspect"
HELP = (
    "Show each FP8 module of a checkpoint (fp8state or TransformerEngine, any era; a torch.save "
    "file or a DCP folder): era, slots, history length, scale and amax ranges, recipe, and the "
    "devices its tensors were saved on."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``PATH`` and ``--json``."""
    parser.add_argument(
        "path", metavar="PATH",
        help="a torch.save file, or a folder written by torch.distributed.checkpoint",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON); errors propagate to the CLI's one-line handler."""
    summary = summarize_checkpoint(args.path)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(summary.format_table())
    return 0
