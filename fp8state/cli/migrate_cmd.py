"""``fp8state migrate SRC DST [--dry-run] [--lenient]``: convert a TE checkpoint to fp8state's.

Writes DST atomically (no partial file on failure) in a form ``torch.load(weights_only=True)``
reads, shows a progress bar on a terminal, and prints the conversion report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from tqdm import tqdm

from fp8state.errors import CheckpointError
from fp8state.migrate.te_checkpoint import migrate_te_checkpoint
from fp8state.migrate.writer import save_atomically

NAME = "migrate"
HELP = (
    "Convert a TransformerEngine checkpoint (any era, v0.1-v2.20) into fp8state's format, "
    "safely: no TE import, no pickled code runs."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``SRC``, ``DST``, ``--dry-run`` and ``--lenient``."""
    parser.add_argument("src", metavar="SRC", help="TE checkpoint written by torch.save")
    parser.add_argument("dst", metavar="DST", help="where to write the converted checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="convert and report; write nothing")
    parser.add_argument(
        "--lenient",
        action="store_true",
        help="drop and report undecodable extra states instead of failing (still exits 0)",
    )


def _progress(keys: Iterable[str], total: int) -> Iterable[str]:
    # tqdm disables itself when stderr is not a terminal (disable=None), keeping logs clean.
    return tqdm(
        keys,
        total=total,
        desc="converting",
        unit="entry",
        file=sys.stderr,
        disable=None,
        leave=False,
    )


def run(args: argparse.Namespace) -> int:
    """Convert, report, write; errors propagate to the CLI's one-line handler."""
    checkpoint, report = migrate_te_checkpoint(
        args.src, strict=not args.lenient, progress=_progress
    )
    print(report.format_text())
    if args.dry_run:
        print(f"dry run: {args.dst} not written")
        return 0
    try:
        save_atomically(checkpoint, args.dst)
    except OSError as err:  # disk full, read-only directory, DST is a folder ...
        raise CheckpointError(
            args.dst,
            f"an error writing it ({err.strerror or err})",
            "a writable file path",
            "Check the path, its permissions and the free space; nothing was written.",
        ) from None
    print(f"wrote {args.dst}")
    return 0
