"""Every hostile input of the corpus, through every CLI command and Python entry point that
reads it, each input in a fresh process under a 4 GiB address-space limit: no code runs (no
sentinel file), nothing in the process changes, nothing is written, the model stays as it
was, each refusal is one FP8StateError (CLI: exit 1, one line, no traceback) and no control
character reaches the terminal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers.paths import TESTS

from fp8state.cli._terminal import escape_controls

from .corpus import CORPUS, HOSTILE_KEY, SENTINEL

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(sys.platform != "linux", reason="address-space limits are Linux's"),
]

PROBE = Path(__file__).with_name("probe.py")
OUTPUTS = ("migrated.pt", "api.pt", "cli.pt")  # what the probe's writers would write


def _raw_controls(text: str) -> list[str]:
    return [c for c in text if c not in "\n\\" and escape_controls(c) != c]


def _probe(kind: str, path: Path, work: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(PROBE), kind, str(path), str(work)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=work,
        env={"PYTHONPATH": f"{TESTS}", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_hostile_input(name: str, tmp_path: Path) -> None:
    build, kind, refused = CORPUS[name]
    path = build(tmp_path)
    result = _probe(kind, path, tmp_path)
    assert not (tmp_path / SENTINEL).exists(), "code from the input ran"
    assert result.pop("attributes_changed") is False
    assert result.pop("model_changed", False) is False
    for entry, outcome in result.items():
        if entry.startswith("cli "):
            command = entry.split()[1]
            assert _raw_controls(outcome["out"]) == [] and _raw_controls(outcome["err"]) == []
            assert "Traceback" not in outcome["err"], (entry, outcome["err"])
            if refused:
                assert outcome["code"] == 1, (entry, outcome)
                assert outcome["out"] == "" and outcome["err"].count("\n") == 1, (entry, outcome)
                assert outcome["err"].startswith(f"fp8state {command}: error: ")
            else:
                assert outcome["code"] == 0, (entry, outcome)
        elif entry == "read_dcp_metadata":  # reads .metadata alone: items may be the attack
            assert outcome["raised"] is None or outcome["fp8state_error"], (entry, outcome)
        elif refused:
            assert outcome.get("fp8state_error") is True, (entry, outcome)
        else:
            assert outcome["raised"] is None, (entry, outcome)
    if refused:
        assert not [out for out in OUTPUTS if (tmp_path / out).exists()]
        assert not list(tmp_path.glob(".*.tmp*")) and not list(tmp_path.glob("*.tmp*"))
    if name == "hostile-keys":
        assert escape_controls(HOSTILE_KEY) in result["cli inspect"]["out"]
