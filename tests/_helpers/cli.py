"""The ``fp8state`` command: in process (``run_cli``), as a console script (``run_console``), and
a stderr that says it is a terminal (``Terminal``)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from fp8state.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``fp8state ARGV...`` in this process: its exit code, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_console(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m fp8state.cli ARGV...`` in a fresh process (two minutes at most)."""
    return subprocess.run(
        [sys.executable, "-m", "fp8state.cli", *argv], capture_output=True, text=True, timeout=120
    )


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True
