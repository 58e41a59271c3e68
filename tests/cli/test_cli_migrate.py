"""``fp8state migrate SRC DST [--dry-run] [--lenient]``: atomic, weights-only readable output.

An existing DST, and writes that fail half-way, are in ``test_cli_files``.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers.cli import Terminal, run_cli, run_console
from _helpers.paths import FIXTURES
from _helpers.state import fields
from te_gen import Module, build, save

from fp8state.cli import migrate_cmd
from fp8state.migrate import load_te_checkpoint, writer

LEGACY = FIXTURES / "te_legacy"
ADV_A = LEGACY / "adv_a_pickle_exec_os_system.pt"


@pytest.mark.parametrize(
    "name",
    ["te_E02_v0.4_dict_recompute.pt", "te_E06_v1.5_bytesio.pt", "te_E10_v2.18_cpu_pickle.pt"],
)
def test_writes_a_weights_only_checkpoint(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "out.pt"
    code, out, err = run_cli(capsys, "migrate", str(LEGACY / name), str(dst))
    assert code == 0 and f"wrote {dst}" in out and "converted " in out
    written = torch.load(dst, weights_only=True)  # no allow-listing needed
    expected = load_te_checkpoint(LEGACY / name)
    assert list(written) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(written[key], value)
        else:
            assert all(torch.equal(written[key][k], v) for k, v in value.items())
    assert list(tmp_path.iterdir()) == [dst]  # no temporary file left behind


def test_dry_run_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "out.pt"
    code, out, _ = run_cli(
        capsys, "migrate", str(LEGACY / "te_E04_v0.7_pickle_u8.pt"), str(dst), "--dry-run"
    )
    assert code == 0 and "dry run" in out and "6 converted, 1 default" in out
    assert not dst.exists() and not list(tmp_path.iterdir())


def test_unsafe_input_fails_without_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"previous content")
    code, out, err = run_cli(capsys, "migrate", str(ADV_A), str(dst), "--overwrite")
    assert code == 1 and "wrote" not in out
    assert err.count("\n") == 1 and "input_proj._extra_state" in err and "posix.system" in err
    assert dst.read_bytes() == b"previous content" and list(tmp_path.iterdir()) == [dst]


def test_lenient_drops_and_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "out.pt"
    code, out, _ = run_cli(capsys, "migrate", str(ADV_A), str(dst), "--lenient")
    assert code == 0 and "failed    input_proj._extra_state" in out and "1 failed" in out
    written = torch.load(dst, weights_only=True)
    assert "input_proj._extra_state" not in written and "input_proj.weight" in written
    assert fields(written["blocks.0.mlp._extra_state"])["fwd.scale"].shape == (6,)


def test_failure_while_writing_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken_save(obj: Any, file: Any) -> None:
        file.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.torch, "save", broken_save)
    dst = tmp_path / "out.pt"
    code, _, err = run_cli(capsys, "migrate", str(LEGACY / "te_E08_v2.3_cpu_pickle.pt"), str(dst))
    assert code == 1 and "No space left on device" in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_destination_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = str(LEGACY / "te_E08_v2.3_cpu_pickle.pt")
    code, _, err = run_cli(capsys, "migrate", src, str(tmp_path))
    assert code == 1 and err.startswith(f"fp8state migrate: error: {tmp_path}: ")
    assert not list(tmp_path.iterdir())


def test_output_that_weights_only_would_refuse_is_not_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = build("E05", [Module("fc.", "Linear")])
    src = tmp_path / "src.pt"
    torch.save({"model": gen.state_dict, "queue": collections.deque([1, 2])}, src)
    code, _, err = run_cli(capsys, "migrate", str(src), str(tmp_path / "out.pt"))
    assert code == 1 and "collections.deque" in err and "weights_only" in err
    assert err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]


def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    keys = [f"k{i}" for i in range(5)]
    assert list(migrate_cmd._progress(keys, len(keys))) == keys
    assert "converting:" in term.getvalue() and "/5 [" in term.getvalue()


def test_console_entry_point(tmp_path: Path) -> None:
    gen = build("E07", [Module("a.", "Linear"), Module("b.", "LayerNorm")])
    save(gen, tmp_path / "te.pt")
    run = run_console("migrate", str(tmp_path / "te.pt"), str(tmp_path / "out.pt"))
    assert run.returncode == 0, run.stderr
    assert "converted a._extra_state" in run.stdout and "dropped   b._extra_state" in run.stdout
    assert set(torch.load(tmp_path / "out.pt", weights_only=True)) == {
        "a.weight",
        "a.bias",
        "a._extra_state",
        "b.weight",
        "b.bias",
    }
