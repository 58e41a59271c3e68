"""``fp8state consolidate DIR OUT``: a DCP checkpoint folder to one ``torch.save`` file."""

from __future__ import annotations

import argparse

from fp8state.checkpoint.consolidation import consolidate
from fp8state.cli._paths import existing_dcp_folder, new_file
from fp8state.cli._terminal import say

NAME = "consolidate"
HELP = (
    "Write a torch.distributed.checkpoint folder as one torch.save file that "
    "torch.load(weights_only=True) reads and a model on one device loads."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``DIR``, ``OUT`` and ``--overwrite``."""
    parser.add_argument("dir", metavar="DIR", help="the DCP checkpoint folder (has .metadata)")
    parser.add_argument("out", metavar="OUT", help="the .pt file to write")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it exists (default: refuse)"
    )
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="read DIR with DCP's own reader, which runs pickled code (default: an allow-list "
        "that runs nothing from the folder)",
    )


def run(args: argparse.Namespace) -> int:
    """Check the paths, consolidate, print one line about the file written, return 0."""
    existing_dcp_folder(args.dir)
    new_file(args.out, overwrite=args.overwrite)  # the library's own message names overwrite=
    result = consolidate(args.dir, args.out, overwrite=args.overwrite, trusted=args.trusted)
    say(
        f"wrote {result.path}: {result.num_tensors} tensors, "
        f"{result.num_bytes / 2**20:.2f} MiB, {len(result.fp8_modules)} FP8 module(s) validated"
    )
    return 0
