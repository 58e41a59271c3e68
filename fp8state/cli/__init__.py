"""The ``fp8state`` console script: one sub-command per module of this package.

Each sub-command module exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. Errors fp8state raises on purpose, and ``OSError``s, become a one-line
message on stderr and exit code 1, never a traceback; bad usage exits 2, as argparse does.
``fp8state --version`` prints ``fp8state <version>``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from fp8state._version import __version__
from fp8state.cli._terminal import say
from fp8state.errors import FP8StateError

__all__ = ["main"]

# Sub-command modules, in the order `fp8state --help` lists them.
_COMMANDS = {
    "demo": "fp8state.cli.demo_cmd",
    "inspect": "fp8state.cli.inspect_cmd",
    "migrate": "fp8state.cli.migrate_cmd",
    "consolidate": "fp8state.cli.consolidate_cmd",
    "export": "fp8state.cli.export_cmd",
}

#: Exit code for an FP8StateError (bad or unsafe input); argparse uses 2 for bad usage.
EXIT_FP8STATE_ERROR = 1
#: Exit code when stdout's reader went away (128 + SIGPIPE, as a shell reports it).
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="fp8state", description="FP8 training with boringly correct checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"fp8state {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, module_name in _COMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args))
    except FP8StateError as err:
        # One line whatever the error holds: its fields, not str(err), which may list
        # problems on lines of their own (StateDictError); escaped like all output.
        line = f"{err.key}: found {err.found}; expected {err.expected}. {err.fix}"
        say(f"fp8state {args.command}: error: {line}", file=sys.stderr)
        return EXIT_FP8STATE_ERROR
    except BrokenPipeError:
        # `fp8state inspect ... | head`: the reader left; stop quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as err:  # permissions, full disk ...: one line, no traceback
        say(f"fp8state {args.command}: error: {_os_error_line(err)}", file=sys.stderr)
        return EXIT_FP8STATE_ERROR


def _os_error_line(err: OSError) -> str:
    """``PATH: reason``, as the checks of each sub-command word it, not ``[Errno 13] ...``."""
    if err.strerror and isinstance(err.filename, (str, bytes)):
        return f"{os.fsdecode(err.filename)}: {err.strerror}"
    return str(err)
