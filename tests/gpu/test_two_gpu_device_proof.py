"""Run the two-GPU device proof under pytest (skipped without two CUDA devices).

The figures land in ``$FP8STATE_PROOF_OUT`` (default: the test's tmp folder); the standalone
command in docs/checkpoints.md does the same without pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not _TWO_GPUS,
        reason="needs two CUDA devices "
        f"(found {torch.cuda.device_count() if torch.cuda.is_available() else 0})",
    ),
]


def test_loading_never_touches_the_other_gpu(tmp_path: Path) -> None:
    out = Path(os.environ.get("FP8STATE_PROOF_OUT", tmp_path / "two_gpu_proof.json"))
    script = Path(__file__).resolve().parent / "two_gpu_device_proof.py"
    done = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    report = json.loads(out.read_text())
    failed = [c for c in report["checks"] if c["status"] not in ("pass", "n/a")]
    assert done.returncode == 0 and not failed, done.stdout + json.dumps(failed, indent=1)
