"""Keys from a checkpoint never reach the terminal raw: control characters in module names
(ESC and OSC sequences, BEL, CR, newlines, bidirectional overrides) are printed as escapes by
every command, each line of output stays one line, and errors stay one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _helpers.cli import run_cli

import fp8state
from fp8state.cli._terminal import escape_controls

# A title change, a colour, a bell, a carriage return over the line, a forged "wrote" line
# and a right-to-left override.
HOSTILE = "blocks.0\x1b]0;owned\x07\x1b[31m\rok\nwrote model.pt\u202e"


def _raw_controls(text: str) -> list[str]:
    """Characters a terminal would act on, other than the newlines ending lines."""
    return [c for c in text if c != "\n" and escape_controls(c) != c and c != "\\"]


def _checkpoint(tmp_path: Path, module_name: str) -> Path:
    state = {f"{module_name}.{k}": v for k, v in fp8state.Linear(16, 16).state_dict().items()}
    path = tmp_path / "hostile.pt"
    torch.save(state, path)
    return path


def test_inspect_prints_hostile_module_names_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _checkpoint(tmp_path, HOSTILE)
    code, out, err = run_cli(capsys, "inspect", str(path))
    assert code == 0, err
    assert _raw_controls(out) == [] and _raw_controls(err) == []
    assert escape_controls(HOSTILE) in out  # the name is there, visibly
    lines = out.splitlines()
    assert not any(line.startswith("wrote") for line in lines)
    # Same lines as the table of a harmless name: nothing was split.
    (tmp_path / "clean").mkdir()
    clean = run_cli(capsys, "inspect", str(_checkpoint(tmp_path / "clean", "blocks0")))[1]
    assert len(lines) == len(clean.splitlines())


def test_inspect_json_carries_the_name_exactly_and_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "inspect", str(_checkpoint(tmp_path, HOSTILE)), "--json")
    assert code == 0 and _raw_controls(out) == []
    modules = json.loads(out)["modules"]
    assert [m["module"] for m in modules] == [HOSTILE]


def test_migrate_report_and_its_last_line_are_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _checkpoint(tmp_path, HOSTILE)
    dst = tmp_path / "out\x1b[2J.pt"
    code, out, err = run_cli(capsys, "migrate", str(src), str(dst))
    assert code == 0, err
    assert _raw_controls(out) == [] and _raw_controls(err) == []
    assert out.splitlines()[-1] == f"wrote {escape_controls(str(dst))}"
    assert sum(line.startswith("wrote") for line in out.splitlines()) == 1
    assert torch.load(dst, weights_only=True).keys() == torch.load(src, weights_only=True).keys()


def test_an_error_naming_a_hostile_key_is_one_escaped_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = fp8state.Linear(16, 16).state_dict()
    state[f"{HOSTILE}._extra_state"] = torch.tensor([3.0, 1.0])  # schema 3 does not exist
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    code, out, err = run_cli(capsys, "inspect", str(path))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("fp8state inspect: error: ")
    assert _raw_controls(err) == []


def test_escapes_are_unambiguous() -> None:
    assert escape_controls("plain.name_0 é 日本") == "plain.name_0 é 日本"
    assert escape_controls("a\x1bb") == "a\\x1bb"
    assert escape_controls("a\\x1bb") == "a\\\\x1bb"  # a literal backslash is not an escape
    assert escape_controls("\x9b\x7f\u2028\u2066") == "\\x9b\\x7f\\u2028\\u2066"
