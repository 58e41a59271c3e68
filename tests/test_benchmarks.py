"""The benchmark script runs end to end (tiny shapes, CPU); its numbers are not checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"linear_speedup", "layernorm_mlp_speedup", "layernorm_mlp_peak_mem_ratio",
        "small_linear_speedup", "quantize_bound_ratio", "state_dict_1000_ms",
        "load_state_dict_1000_ms", "scale_update_ms", "torch", "gpu", "command"}


def test_hopper_benchmark_quick_run_writes_every_key(tmp_path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hopper.py"), "--quick", "--device", "cpu",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert KEYS <= result.keys()
    assert all(v > 0 for v in result["linear_speedup"].values())
    assert result["command"] == "python benchmarks/hopper.py --quick"


def test_docs_benchmarks_table_matches_the_recorded_run() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_recorded_run_has_every_key() -> None:
    result = json.loads((ROOT / "benchmarks" / "results" / "h200.json").read_text())
    assert KEYS <= result.keys()
    assert result["gpu"].startswith("NVIDIA H200")
