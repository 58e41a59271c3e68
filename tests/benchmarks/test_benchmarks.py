"""The benchmark script runs end to end (tiny shapes, CPU); its numbers are not checked here."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from types import ModuleType

import torch
from _helpers.paths import REPO_ROOT

KEYS = {
    "linear_speedup",
    "layernorm_mlp_speedup",
    "layernorm_mlp_peak_mem_ratio",
    "small_linear_speedup",
    "quantize_bound_ratio",
    "state_dict_1000_ms",
    "load_state_dict_1000_ms",
    "scale_update_ms",
    "torch",
    "gpu",
    "command",
}


def _benchmark_module(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` imported as its script sees its neighbours (on ``sys.path``)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))


def test_hopper_benchmark_quick_run_writes_every_key(tmp_path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "hopper.py"),
            "--quick",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert KEYS <= result.keys()
    assert all(v > 0 for v in result["linear_speedup"].values())
    # Steady-state (back-to-back) and per-step-synchronized timings, side by side.
    for case in result["details"]["linear"].values():
        assert {"ratio", "synced_ratio"} <= case.keys() and case["synced_ratio"] > 0
    assert result["command"] == "python benchmarks/hopper.py --quick"
    floors = {
        f"{name}_{what}_ms"
        for name in ("plain_linear", "extra_state_linear")
        for what in ("state_dict", "load_state_dict")
    }
    assert floors | {"schema_floor_state_dict_ms"} <= result["details"]["metadata"].keys()


def test_peak_memory_replay_finds_the_blocks_alive_at_the_peak() -> None:
    peak_blocks = _benchmark_module("peak_memory").peak_blocks
    events = [
        {"action": "alloc", "addr": 1, "size": 10},
        {"action": "alloc", "addr": 2, "size": 5},
        {"action": "free_requested", "addr": 1, "size": 10},
        {"action": "free_requested", "addr": 99, "size": 64},  # allocated before recording
        {"action": "alloc", "addr": 3, "size": 7},
        {"action": "free_completed", "addr": 1, "size": 10},
    ]
    peak, blocks = peak_blocks(events)
    assert peak == 15
    assert [b["addr"] for b in blocks] == [1, 2]  # largest first


def test_docs_benchmarks_table_matches_the_recorded_run() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "render.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_recorded_run_has_every_key() -> None:
    result = json.loads((REPO_ROOT / "benchmarks" / "results" / "h200.json").read_text())
    assert KEYS <= result.keys()
    assert result["gpu"].startswith("NVIDIA H200")


def _script(script: str, *args: str, timeout: int) -> str:
    """Run ``benchmarks/SCRIPT ARGS...``; its stdout (the run must succeed)."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _quick_run(script: str, tmp_path, timeout: int, *args: str) -> dict:
    out = tmp_path / "result.json"
    out.write_text('{"earlier": 1}\n')  # --out merges its keys into what is there
    _script(script, "--quick", "--device", "cpu", "--out", str(out), *args, timeout=timeout)
    result = json.loads(out.read_text())
    assert result.pop("earlier") == 1
    return result


def test_checkpoint_round_trip_benchmark_quick_run(tmp_path) -> None:
    result = _quick_run("checkpoint_roundtrip.py", tmp_path, 300)["checkpoint_roundtrip"]
    assert result["ratio"] > 0 and result["parameters"] > 0
    assert len(result["rounds"]["fp8state"]) == len(result["rounds"]["torch_nn"]) == 2
    assert result["command"] == "python benchmarks/checkpoint_roundtrip.py --quick"


def test_training_loop_benchmark_quick_run(tmp_path) -> None:
    result = _quick_run("training_loop.py", tmp_path, 600)
    sweeps = ("sweep_speedup", "sweep_context_ceiling", "sweep_floor")
    assert all(set(result[key]) == {"64x32x32"} for key in sweeps)
    modes = {"eager_1x32", "eager_4x32", "compiled_1x32"}
    tuned = {"tuned_eager_1x32", "tuned_eager_4x32"}
    floors = {f"floor_{mode}" for mode in modes}
    assert set(result["model_h2048_speedup"]) == modes | floors | tuned
    assert set(result["fallback_tuning"]) == {"1x32", "4x32"}
    for tuning in result["fallback_tuning"].values():
        assert str(tuning["chosen"]) in tuning["ms_per_step"]
        assert all(size >= tuning["chosen"] for size in tuning["fp8_gemm_macs"])
    assert all(isinstance(v, float) and v > 0 for v in result["model_h2048_speedup"].values())
    assert result["compile_graph_breaks"] >= 0 and result["compile_recompiles"] >= 0
    assert result["training_loop_run"]["command"] == "python benchmarks/training_loop.py --quick"


def test_training_loop_sweeps_only_the_shapes_asked_for(tmp_path) -> None:
    args = ("--skip", "model", "host", "--shapes", "48x32x16", "16x32x48")
    result = _quick_run("training_loop.py", tmp_path, 300, *args)
    assert list(result["sweep_speedup"]) == ["48x32x16", "16x32x48"]
    assert (
        set(result["sweep_context_ceiling"])
        == set(result["sweep_floor"])
        == {"48x32x16", "16x32x48"}
    )
    assert "model_h2048_speedup" not in result and "host_overhead_ratio" not in result
    command = result["training_loop_run"]["command"]
    assert command.endswith("--skip model host --shapes 48x32x16 16x32x48")


def test_compiled_modes_benchmark_quick_run(tmp_path) -> None:
    result = _quick_run("compiled_modes.py", tmp_path, 600)["compiled_modes_1x32"]
    assert set(result["default"]) == {"eager_threshold", "fp8_graphed"}
    assert all(isinstance(v, float) and v > 0 for v in result["default"].values())
    assert result["command"] == "python benchmarks/compiled_modes.py --quick"


def test_compiled_microbatches_benchmark_quick_run(tmp_path) -> None:
    result = _quick_run("compiled_microbatches.py", tmp_path, 600)["microbatch_caching_quick"]
    for mode in ("eager", "eager_ahead", "compiled"):
        assert set(result[mode]) == {"ratio", "every_micro_batch_ms", "cached_ms"}
        assert all(isinstance(v, float) and v > 0 for v in result[mode].values())
    assert result["command"] == "python benchmarks/compiled_microbatches.py --quick"


def test_compiled_microbatches_benchmark_runs_the_modes_asked_for(tmp_path) -> None:
    run = _quick_run("compiled_microbatches.py", tmp_path, 300, "--modes", "eager_ahead")
    result = run["microbatch_caching_quick"]
    assert set(result) == {"command", "micro_batches", "eager_ahead"}
    assert result["eager_ahead"]["ratio"] > 0
    expected = "python benchmarks/compiled_microbatches.py --quick --modes eager_ahead"
    assert result["command"] == expected


def test_profile_step_benchmark_quick_run() -> None:
    stdout = _script("profile_step.py", "--quick", "--top", "5", "--every-gemm-fp8", timeout=600)
    for mode in ("eager", "compiled"):
        for model in ("fp8state", "bf16"):
            assert f"== {mode} {model}: host " in stdout
    assert stdout.count("Ordered by: internal time") == 2  # one profile per FP8 mode


def test_take_part_cost_benchmark_runs_two_gloo_ranks() -> None:
    stdout = _script("take_part_cost.py", "--quick", timeout=300)
    for case in (
        "every layer fp8state's, world group",
        "the first layer fp8state's, world group",
        "every layer fp8state's, a group of its own rank",
        "nn.Linear layers inside fp8_autocast, world group",
        "nn.Linear layers",
    ):
        assert f"\n{case}: " in f"\n{stdout}"
    assert "taking part: " in stdout and "us per fallback call" in stdout


def test_fallback_probe_host_mode_runs_on_cpu() -> None:
    stdout = _script(
        "fallback_probe.py",
        "--host",
        "--device",
        "cpu",
        "--rounds",
        "1",
        "--calls",
        "20",
        timeout=300,
    )
    rows = dict(line.rsplit(": ", 1) for line in stdout.strip().splitlines())
    assert set(rows) == {
        "fp8_autocast enter+exit",
        "nn.Linear forward in fp8_autocast",
        "fp8state.Linear fallback forward in fp8_autocast",
        "nn.Linear step",
        "nn.Linear step in fp8_autocast",
        "fp8state.Linear fallback step",
    }
    assert all(float(us.removesuffix(" us")) > 0 for us in rows.values())


def test_byte_floor_counts_every_cast_and_filters_on_fp8states_kernels() -> None:
    byte_floor = _benchmark_module("byte_floor")
    OWN_KERNELS, layer_bytes = byte_floor.OWN_KERNELS, byte_floor.layer_bytes
    t, h, f = 2048, 1024, 4096
    counted = layer_bytes(t, h, f)
    # Eleven casts of a bf16 operand into both FP8 layouts (4 bytes an element), GELU's
    # derivative (a second bf16 input: 6), two norms' backward (two bf16 inputs, one output: 6).
    assert len(counted) == 14
    assert sum(counted.values()) == 44 * t * h + 16 * h * h + 8 * f * h + 10 * t * f
    # The profile keeps launches by these names: each must be a Triton kernel of fp8state's.
    kernels: set[str] = set()
    for path in (REPO_ROOT / "fp8state" / "_kernels").glob("*.py"):
        kernels |= set(re.findall(r"@triton\.jit[^\n]*\ndef (\w+)", path.read_text()))
    assert set(OWN_KERNELS) <= kernels


def test_scale_update_host_benchmark_runs_on_cpu() -> None:
    stdout = _script(
        "scale_update_host.py",
        *("--device", "cpu", "--modules", "6", "--iters", "3", "--rounds", "2"),
        timeout=300,
    )
    header, *rounds = stdout.strip().splitlines()
    assert "6 modules on cpu" in header and len(rounds) == 2
    for line in rounds:  # no pointer table and no GPU timing off CUDA
        result = json.loads(line)
        assert set(result) == {"synchronized_ms", "host_ms_back_to_back", "close_steps_ms"}
        assert all(v > 0 for v in result.values())


def test_dcp_metadata_read_benchmark_runs() -> None:
    stdout = _script("dcp_metadata_read.py", "--entries", "20", "--rounds", "1", timeout=300)
    result = json.loads(stdout)
    assert result["entries"] == 20 and result["allow_list_ms"] > 0 < result["plain_pickle_ms"]


def test_untrusted_load_benchmark_runs() -> None:
    stdout = _script(
        "untrusted_load.py", "--tensors", "8", "--elements", "16", "--rounds", "1", timeout=300
    )
    result = json.loads(stdout)
    assert result["tensors"] == 8 and result["bytes"] == 8 * 16 * 4
    assert result["dcp"]["ratio"] > 0 < result["dcp"]["ratio_trusted"]
    assert result["file"]["ratio"] > 0


def test_model_step_accumulates_gradients_unless_asked_for_fresh_ones() -> None:
    transformer = _benchmark_module("transformer")
    build_model, make_step = transformer.build_model, transformer.make_step
    shape = {"layers": 1, "hidden": 32, "ffn": 64, "heads": 2}
    model = build_model(False, torch.device("cpu"), **shape)
    x = torch.randn(1, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def tensors() -> list[torch.Tensor]:
        return [*(p.grad for p in model.parameters()), x.grad]

    make_step(model, x, grad, False)()
    once = [t.clone() for t in tensors()]
    make_step(model, x, grad, False)()  # a second step adds to the first's
    assert all(torch.equal(t, 2 * g) for t, g in zip(tensors(), once, strict=True))
    make_step(model, x, grad, False, fresh_grads=True)()  # from None: one step's again
    assert all(torch.equal(t, g) for t, g in zip(tensors(), once, strict=True))
