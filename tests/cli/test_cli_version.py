"""``fp8state --version``, and ``python -m fp8state`` as the console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fp8state._version import __version__
from fp8state.cli import main


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:  # argparse's --version, like --help, exits
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"fp8state {__version__}\n"


def _python_m_fp8state(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fp8state", *argv], capture_output=True, text=True, timeout=120
    )


def test_python_m_fp8state_version() -> None:
    run = _python_m_fp8state("--version")
    assert run.returncode == 0 and run.stderr == ""
    assert run.stdout == f"fp8state {__version__}\n"


def test_python_m_fp8state_runs_a_sub_command(tmp_path: Path) -> None:
    run = _python_m_fp8state("inspect", str(tmp_path / "missing.pt"))
    assert run.returncode == 1 and run.stdout == "" and "Traceback" not in run.stderr
    assert run.stderr == (
        f"fp8state inspect: error: {tmp_path / 'missing.pt'}: found no such file or folder; "
        "expected a torch.save file, a DCP folder or an FP8 metadata .safetensors file. Check "
        "the path (relative paths start from the current directory).\n"
    )
