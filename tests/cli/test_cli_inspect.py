"""``fp8state inspect PATH [--json]`` on TE checkpoints of every kind and on fp8state's own."""

from __future__ import annotations

import doctest
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers.cli import run_cli, run_console
from _helpers.dcp import replace_planner_data
from _helpers.paths import FIXTURES
from te_gen import Module, Spec, build, save
from te_gen.adversarial import Call

import fp8state
from fp8state.checkpoint import dcp_save
from fp8state.cli import EXIT_BROKEN_PIPE, main
from fp8state.migrate import summary

LEGACY = FIXTURES / "te_legacy"
REAL = FIXTURES / "te_real_2.20"


def test_table_for_an_old_era_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "inspect", str(LEGACY / "te_E01_v0.2_list.pt"))
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
    _, table, _ = run_cli(capsys, "inspect", path)
    code, out, _ = run_cli(capsys, "inspect", path, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["loads_onto"] == "cpu" and doc["state_dicts"] == [""]
    modules = {m["module"]: m for m in doc["modules"]}
    assert set(modules) == {line.split()[0] for line in table.splitlines()[1:5]}
    attn = modules["layer.self_attention.core_attention"]
    assert attn["slots"] == {"fwd": 9, "bwd": 6} and attn["amax_range"] is None
    assert attn["scale_range"] == [1.0, 1.0]
    mlp = modules["layer.layernorm_mlp"]
    assert mlp["era"] == "E08-E10" and mlp["history_rows"] == 1024
    assert mlp["recipe"] == {
        "fp8_format": "HYBRID",
        "margin": 0,
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
    }
    assert mlp["recipe_source"] == "pickled recipe" and "cuda:0" in mlp["saved_locations"]
    low, high = mlp["amax_range"]
    assert 0 < low <= high


def test_fp8state_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = torch.nn.Sequential(fp8state.Linear(8, 8), fp8state.LayerNormMLP(8, 16))
    torch.save({"model": model.state_dict(), "epoch": 2}, tmp_path / "ours.pt")
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path / "ours.pt"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["state_dicts"] == ["model"]
    assert [(m["module"], m["era"], m["slots"]["fwd"]) for m in doc["modules"]] == [
        ("0", "fp8state schema v2", 3),
        ("1", "fp8state schema v2", 6),
    ]
    assert doc["modules"][0]["saved_locations"] == ["cpu"]


def test_fp8_metadata_safetensors_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = torch.nn.Sequential(fp8state.Linear(16, 16), fp8state.LayerNormMLP(16, 32))
    with fp8state.fp8_autocast():
        model(torch.randn(4, 16)).sum().backward()
    fp8state.checkpoint.save_safetensors(
        model, tmp_path / "w.safetensors", fp8_metadata_path=tmp_path / "fp8.safetensors"
    )
    code, out, err = run_cli(capsys, "inspect", str(tmp_path / "fp8.safetensors"), "--json")
    doc = json.loads(out)
    assert code == 0 and not err and doc["source"] == str(tmp_path / "fp8.safetensors")
    assert [(m["module"], m["slots"]["fwd"]) for m in doc["modules"]] == [("0", 3), ("1", 6)]
    scales = torch.cat([model[0].fp8_meta(d).scale for d in ("fwd", "bwd")])
    assert doc["modules"][0]["scale_range"] == [float(scales.min()), float(scales.max())]
    code, out, err = run_cli(capsys, "inspect", str(tmp_path / "w.safetensors"))
    assert code == 1 and not out and err.count("\n") == 1
    assert "a safetensors file of 8 plain tensors (no FP8 metadata in it)" in err
    assert "truncated or corrupt" not in err


def test_generated_nested_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    gen = build(
        "E04", [Module("encoder.layers.11.mlp.", "LayerNormMLP", spec=Spec(rows=7, fmt="E4M3"))]
    )
    save(gen, tmp_path / "te.pt", wrap="state_dict")
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path / "te.pt"))
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("encoder.layers.11.mlp "))
    assert " E04 " in row and " 6/4 " in row and "E4M3 m=0 len=7 max (defaults)" in row


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("adv_a_pickle_exec_os_system.pt", "posix.system"),
        ("adv_b_truncated.pt", "damaged zip archive"),
        ("does_not_exist.pt", "found no such file or folder"),
    ],
)
def test_bad_input_one_line_error(
    name: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "inspect", str(LEGACY / name))
    assert code == 1 and not out
    assert err.count("\n") == 1 and err.startswith("fp8state inspect: error: ") and reason in err


def test_console_entry_point_prints_no_traceback() -> None:
    run = run_console("inspect", str(LEGACY / "adv_b_truncated.pt"))
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and "truncated or corrupt" in run.stderr


def test_output_into_a_closed_pipe_ends_quietly(tmp_path, monkeypatch) -> None:
    """`fp8state inspect ... | head`: no BrokenPipeError traceback, the shell's exit code."""
    path = tmp_path / "ckpt.pt"
    torch.save(fp8state.Linear(16, 16).state_dict(), path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write raises BrokenPipeError
    stdout = io.TextIOWrapper(os.fdopen(write_end, "wb", buffering=0), write_through=True)
    monkeypatch.setattr("sys.stdout", stdout)
    assert main(["inspect", str(path)]) == EXIT_BROKEN_PIPE


def test_os_errors_are_one_line(tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "missing.pt")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp8state inspect: error:") and "\n" not in err


# ------------------------------- DCP folders: shown like torch.save files, crafted ones run nothing


def _trained_linears() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(fp8state.Linear(16, 16), fp8state.Linear(16, 8, bias=False))
    for _ in range(2):
        with fp8state.fp8_autocast():
            model(torch.randn(4, 16)).sum().backward()
    return model


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_folder_shows_what_the_same_torch_save_file_shows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = _trained_linears()
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.save(model.state_dict(), tmp_path / "same.pt")
    code, out, err = run_cli(capsys, "inspect", str(tmp_path / "dcp"), "--json")
    assert code == 0 and not err
    from_dcp = json.loads(out)
    _, out, _ = run_cli(capsys, "inspect", str(tmp_path / "same.pt"), "--json")
    from_file = json.loads(out)
    assert from_dcp["source"] == str(tmp_path / "dcp") and from_dcp["state_dicts"] == [""]
    assert [m["module"] for m in from_dcp["modules"]] == ["0", "1"]
    for row_dcp, row_file in zip(from_dcp["modules"], from_file["modules"], strict=True):
        assert row_dcp["saved_locations"] == [] and row_file["saved_locations"] == ["cpu"]
        row_dcp.pop("saved_locations"), row_file.pop("saved_locations")
        assert row_dcp == row_file  # era, slots, rows, scale and amax ranges, recipe
    scales = torch.cat([model[0].fp8_meta(d).scale for d in ("fwd", "bwd")])
    assert from_dcp["modules"][0]["scale_range"] == [float(scales.min()), float(scales.max())]
    code, table, _ = run_cli(capsys, "inspect", str(tmp_path / "dcp"))
    assert code == 0 and f"2 FP8 module(s) in {tmp_path / 'dcp'}" in table


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_folder_with_the_model_under_a_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    dcp_save(_trained_linears(), tmp_path / "dcp", key="model")
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path / "dcp"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["state_dicts"] == ["model"]
    assert [(m["module"], m["slots"]) for m in doc["modules"]] == [
        ("0", {"fwd": 3, "bwd": 2}),
        ("1", {"fwd": 3, "bwd": 2}),
    ]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_crafted_dcp_metadata_runs_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder, marker = tmp_path / "dcp", tmp_path / "ran"
    dcp.save(fp8state.Linear(4, 4).state_dict(), checkpoint_id=str(folder), no_dist=True)

    replace_planner_data(folder, Call(os.system, f"touch {marker}"))
    code, out, err = run_cli(capsys, "inspect", str(folder))
    assert code == 1 and not out and not marker.exists()
    assert err.count("\n") == 1 and "posix.system" in err and "Nothing was executed" in err


def test_folder_that_is_not_a_dcp_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run_cli(capsys, "inspect", str(tmp_path))
    assert code == 1 and not out
    assert err.count("\n") == 1 and "a folder without .metadata" in err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_console_entry_point_reads_a_dcp_folder_quietly(tmp_path: Path) -> None:
    dcp.save(_trained_linears().state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    run = run_console("inspect", str(tmp_path))
    assert run.returncode == 0 and run.stderr == ""  # not even DCP's single-process warning
    assert "2 FP8 module(s)" in run.stdout


# ------------------------------------------------- the era legend: the TE releases of each era


def test_table_ends_with_the_legend_of_its_eras(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "inspect", str(LEGACY / "te_E01_v0.2_list.pt"))
    lines = out.splitlines()
    assert code == 0 and lines[7] == "era E01: TE v0.1-v0.2"  # after the 6 rows, before the count
    assert lines[8].startswith("6 FP8 module(s) in ")
    assert [line for line in lines if line.startswith("era ")] == ["era E01: TE v0.1-v0.2"]


def test_json_legend_for_a_real_te_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "inspect", str(REAL / "te2.20_lnmlp_gelu_default.pt"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["eras"] == {"E08-E10": "TE v2.0-v2.20"}
    assert {m["era"] for m in doc["modules"]} == {"E08-E10"}


@pytest.mark.parametrize(
    ("name", "legend"),
    [
        ("te_E02_v0.4_dict_recompute.pt", {"E02": "TE v0.3-v0.4"}),
        ("te_E03_v0.5_dict.pt", {"E03": "TE v0.5"}),
        ("te_E05_v0.11_pickle_u8_scaleinv.pt", {"E05": "TE v0.8-v0.11"}),
        ("te_E06_v1.5_bytesio.pt", {"E06": "TE v0.12-v1.5"}),
        ("te_E07_v1.13_bytesio.pt", {"E07": "TE v1.6-v1.13"}),
        ("te_E09_v2.10_cpu_pickle.pt", {"E08-E10": "TE v2.0-v2.20"}),
    ],
)
def test_every_era_in_the_table_is_in_the_legend(
    name: str, legend: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = run_cli(capsys, "inspect", str(LEGACY / name), "--json")
    doc = json.loads(out)
    assert doc["eras"] == legend and {m["era"] for m in doc["modules"]} == set(legend)
    _, table, _ = run_cli(capsys, "inspect", str(LEGACY / name))
    assert [line for line in table.splitlines() if line.startswith("era ")] == [
        f"era {code}: {te}" for code, te in legend.items()
    ]


def test_no_legend_for_fp8state_checkpoints(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch.save(fp8state.Linear(8, 8).state_dict(), tmp_path / "ours.pt")
    _, out, _ = run_cli(capsys, "inspect", str(tmp_path / "ours.pt"), "--json")
    assert json.loads(out)["eras"] == {}  # "fp8state schema v2" says what it is
    _, table, _ = run_cli(capsys, "inspect", str(tmp_path / "ours.pt"))
    assert not [line for line in table.splitlines() if line.startswith("era ")]


def test_the_legend_example_in_its_docstring_holds() -> None:
    (test,) = doctest.DocTestFinder().find(summary.era_legend, globs=vars(summary))
    result = doctest.DocTestRunner().run(test)
    assert result.attempted == 1 and result.failed == 0
