"""``fp8state inspect PATH [--json]`` on TE checkpoints of every kind and on fp8state's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from te_gen import Module, Spec, build, save
from te_gen.expect import FIXTURES

import fp8state
from fp8state.cli import main

LEGACY = FIXTURES / "te_legacy"
REAL = FIXTURES / "te_real_2.20"


def _inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_for_an_old_era_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _inspect(capsys, str(LEGACY / "te_E01_v0.2_list.pt"))
    assert code == 0 and not err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["module", "era", "slots", "f/b"]
    rows = [line for line in lines[1:] if " E01 " in line]
    assert len(rows) == 6
    mlp = next(line for line in rows if line.startswith("blocks.0.mlp "))
    assert "4/2->6/4" in mlp and "HYBRID m=0 len=4 max (defaults)" in mlp
    assert "cpu,cuda:0" in mlp  # parameters saved from CPU, FP8 tensors from cuda:0
    assert "without FP8 state: lm_head._extra_state" in out


def test_json_matches_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(REAL / "te2.20_transformer_layer_default.pt")
    _, table, _ = _inspect(capsys, path)
    code, out, _ = _inspect(capsys, path, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["loads_onto"] == "cpu" and doc["state_dicts"] == [""]
    modules = {m["module"]: m for m in doc["modules"]}
    assert set(modules) == {line.split()[0] for line in table.splitlines()[1:5]}
    attn = modules["layer.self_attention.core_attention"]
    assert attn["slots"] == {"fwd": 9, "bwd": 6} and attn["amax_range"] is None
    assert attn["scale_range"] == [1.0, 1.0]
    mlp = modules["layer.layernorm_mlp"]
    assert mlp["era"] == "E08-E10" and mlp["history_rows"] == 1024
    assert mlp["recipe"] == {"fp8_format": "HYBRID", "margin": 0, "amax_history_len": 1024,
                             "amax_compute_algo": "max"}
    assert mlp["recipe_source"] == "pickled recipe" and "cuda:0" in mlp["saved_locations"]
    low, high = mlp["amax_range"]
    assert 0 < low <= high


def test_fp8state_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = torch.nn.Sequential(fp8state.Linear(8, 8), fp8state.LayerNormMLP(8, 16))
    torch.save({"model": model.state_dict(), "epoch": 2}, tmp_path / "ours.pt")
    code, out, _ = _inspect(capsys, str(tmp_path / "ours.pt"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["state_dicts"] == ["model"]
    assert [(m["module"], m["era"], m["slots"]["fwd"]) for m in doc["modules"]] == [
        ("0", "fp8state schema v1", 3), ("1", "fp8state schema v1", 6)]
    assert doc["modules"][0]["saved_locations"] == ["cpu"]


def test_generated_nested_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    gen = build("E04", [Module("encoder.layers.11.mlp.", "LayerNormMLP",
                               spec=Spec(rows=7, fmt="E4M3"))])
    save(gen, tmp_path / "te.pt", wrap="state_dict")
    code, out, _ = _inspect(capsys, str(tmp_path / "te.pt"))
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("encoder.layers.11.mlp "))
    assert " E04 " in row and " 6/4 " in row and "E4M3 m=0 len=7 max (defaults)" in row


@pytest.mark.parametrize(("name", "reason"), [
    ("adv_a_pickle_exec_os_system.pt", "posix.system"),
    ("adv_b_truncated.pt", "damaged zip archive"),
    ("does_not_exist.pt", "No such file"),
])
def test_bad_input_one_line_error(name: str, reason: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _inspect(capsys, str(LEGACY / name))
    assert code == 1 and not out
    assert err.count("\n") == 1 and err.startswith("fp8state inspect: error: ") and reason in err


def test_console_entry_point_prints_no_traceback() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "fp8state.cli", "inspect", str(LEGACY / "adv_b_truncated.pt")],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and "truncated or corrupt" in run.stderr


def test_output_into_a_closed_pipe_ends_quietly(tmp_path, monkeypatch) -> None:
    """`fp8state inspect ... | head`: no BrokenPipeError traceback, the shell's exit code."""
    import io
    import os

    import torch

    import fp8state
    from fp8state.cli import EXIT_BROKEN_PIPE, main

    path = tmp_path / "ckpt.pt"
    torch.save(fp8state.Linear(16, 16).state_dict(), path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write raises BrokenPipeError
    stdout = io.TextIOWrapper(os.fdopen(write_end, "wb", buffering=0), write_through=True)
    monkeypatch.setattr("sys.stdout", stdout)
    assert main(["inspect", str(path)]) == EXIT_BROKEN_PIPE


def test_os_errors_are_one_line(tmp_path, capsys) -> None:
    from fp8state.cli import main

    assert main(["inspect", str(tmp_path / "missing.pt")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp8state inspect: error:") and "\n" not in err
