"""Every script in examples/ runs as is on CPU, prints what it shows, and fails when it should."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from _helpers.paths import FIXTURES, REPO_ROOT
from _helpers.state import fields

import fp8state

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.py"))

#: What each example must print (regular expressions searched in its stdout).
KEY_OUTPUT = {
    "export_for_serving": [r"wrote llama-fp8: 15 FP8 layers; in the training dtype: .*model\.norm"],
    "custom_module": [r"reloaded with torch\.load\(weights_only=True\): FP8 metadata identical"],
    "train_resume": [r"resumed at step 8: .* identical bit for bit"],
    "convert_te_checkpoint": [
        r"fp8state\.checkpoint\.load refuses it: TransformerEngine extra state",
        r"1 extra states \(1 converted\); 2 other tensors unchanged",
        r"recipe from the checkpoint: HYBRID, margin 0, amax_history_len 1024, max",
        r"one FP8 step on cpu: .* continues",
    ],
    "dcp_two_ranks": [
        r"2 ranks trained",
        r"identical to rank 0's model: True",
        r"FP8 modules \['0\._extra_state', '2\._extra_state'\]",
        r"gives the same model: True",
    ],
    "recalibrate": [r"recalibrated 2 FP8 modules on 4 batches", r"dB after recalibrate"],
}


def _run(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    # From a plain clone: the repository on the path, not an installed fp8state.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script: Path, tmp_path: Path) -> None:
    proc = _run(script, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert script.stem in KEY_OUTPUT, f"say in KEY_OUTPUT what {script.name} must print"
    for pattern in KEY_OUTPUT[script.stem]:
        assert re.search(pattern, proc.stdout), f"{pattern!r} not in:\n{proc.stdout}"
    if script.stem == "convert_te_checkpoint":
        _check_against_te_truth(proc.stdout)


def _check_against_te_truth(stdout: str) -> None:
    """The scales the example printed are the values TE itself decoded from the file."""
    fixture = FIXTURES / "te_real_2.20" / "te2.20_linear_bias_default.pt"
    copy = REPO_ROOT / "examples" / "data" / fixture.name
    assert copy.read_bytes() == fixture.read_bytes()
    truth = json.loads(fixture.with_suffix(".json").read_text())["modules"]["proj"]
    for direction in ("fwd", "bwd"):
        printed = re.search(rf"^proj {direction}\.scale (\[.*\])$", stdout, re.MULTILINE)
        assert printed, stdout
        assert json.loads(printed.group(1)) == truth[f"scale_{direction}"]["values"]


def test_there_are_examples() -> None:
    assert {p.stem for p in EXAMPLES} >= set(KEY_OUTPUT)


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", REPO_ROOT / "examples" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The examples' own checks can fail: break what each one checks and it returns 1.


def test_train_resume_fails_when_the_checkpoint_is_not_loaded(monkeypatch, capsys) -> None:
    example = _load("train_resume")
    monkeypatch.setattr(example.fp8state.checkpoint, "load_state_dict", lambda model, sd: None)
    assert example.main() == 1
    assert "resume differs" in capsys.readouterr().err


def test_convert_fails_when_a_scale_is_wrong(monkeypatch, capsys) -> None:
    example = _load("convert_te_checkpoint")
    real = example.migrate_te_checkpoint

    def off_by_one_ulp(path):
        converted, report = real(path)
        scale = fields(converted["proj._extra_state"])["fwd.scale"]  # a view: edits in place
        scale[0] = torch.nextafter(scale[0], torch.tensor(0.0))
        return converted, report

    monkeypatch.setattr(example, "migrate_te_checkpoint", off_by_one_ulp)
    assert example.main() == 1
    assert "fwd scales do not match" in capsys.readouterr().err


def test_recalibrate_example_fails_without_recalibration(monkeypatch, capsys) -> None:
    example = _load("recalibrate")

    def nothing(model, batches):
        return fp8state.CalibrationReport(
            batches=0, modules=(), skipped=(), backward=False, recipe=fp8state.DelayedScaling()
        )

    monkeypatch.setattr(example.fp8state, "recalibrate", nothing)
    assert example.main() == 1
    assert "did not restore" in capsys.readouterr().err


def test_dcp_example_compares_every_tensor() -> None:
    example = _load("dcp_two_ranks")
    model = example.build_model(seed=0)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    assert example.same_state(model, reference)
    fields(reference["2._extra_state"])["fwd.scale"].mul_(2)  # a view: edits in place
    assert not example.same_state(model, reference)
    reference = {k: v for k, v in reference.items() if k != "0.weight"}
    assert not example.same_state(model, reference)
