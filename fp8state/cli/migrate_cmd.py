"""``fp8state migrate SRC DST [--dry-run] [--lenient] [--overwrite]``: TE checkpoint to fp8state's.

Writes DST atomically (no partial file on failure) in a form ``torch.load(weights_only=True)``
reads, shows a progress bar on a terminal, and prints the conversion report. An existing DST is
refused unless ``--overwrite`` is given (it may be the only copy of an earlier conversion, or
of anything else), and SRC, often a checkpoint that cannot be made again, is never replaced.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable

from tqdm import tqdm

from fp8state.cli._paths import existing_file, new_file, refuse_existing
from fp8state.cli._terminal import say
from fp8state.errors import CheckpointError
from fp8state.migrate.te_checkpoint import migrate_te_checkpoint
from fp8state.migrate.writer import save_atomically

NAME = "migrate"
HELP = (
    "Convert a TransformerEngine checkpoint (any era, v0.1-v2.20) into fp8state's format, "
    "safely: no TE import, no pickled code runs."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``SRC``, ``DST``, ``--dry-run``, ``--lenient`` and ``--overwrite``."""
    parser.add_argument("src", metavar="SRC", help="TE checkpoint written by torch.save")
    parser.add_argument("dst", metavar="DST", help="where to write the converted checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="convert and report; write nothing")
    parser.add_argument(
        "--lenient",
        action="store_true",
        help="drop and report undecodable extra states instead of failing (still exits 0)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace DST if it exists (default: refuse)"
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


def _check_paths(args: argparse.Namespace) -> bool:
    """Check SRC and DST before converting; True if DST exists (for the dry run's last line)."""
    existing_file(args.src, "a TE checkpoint file written by torch.save", "migrate")
    exists = os.path.lexists(args.dst)
    if exists and os.path.isfile(args.dst) and os.path.samefile(args.src, args.dst):
        raise CheckpointError(
            args.dst,
            "SRC itself",
            "a new file for the converted checkpoint",
            "Write the conversion elsewhere and keep the TE checkpoint; --overwrite does not "
            "replace SRC.",
        )
    new_file(args.dst, overwrite=args.overwrite or args.dry_run)
    return exists


def run(args: argparse.Namespace) -> int:
    """Check the paths, convert, report, write; errors go to the CLI's one-line handler."""
    dst_exists = _check_paths(args)
    checkpoint, report = migrate_te_checkpoint(
        args.src, strict=not args.lenient, progress=_progress
    )
    say(*report.text_lines())
    if args.dry_run:
        refused = dst_exists and not args.overwrite
        note = " (it exists: without --overwrite, migrate would refuse it)" if refused else ""
        say(f"dry run: {args.dst} not written{note}")
        return 0
    try:
        save_atomically(checkpoint, args.dst, overwrite=args.overwrite)
    except FileExistsError:  # written by someone else while this one converted
        raise refuse_existing(args.dst) from None
    except OSError as err:  # disk full, read-only directory ...
        raise CheckpointError(
            args.dst,
            f"an error writing it ({err.strerror or err})",
            "a writable file path",
            "Check the path, its permissions and the free space; nothing was written.",
        ) from None
    say(f"wrote {args.dst}")
    return 0
