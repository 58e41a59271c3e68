"""A path that cannot be what a sub-command needs is one line naming it, before any work.

The convention is the CLI's own for bad input (``fp8state.cli.EXIT_FP8STATE_ERROR``, 1):
``fp8state COMMAND: error: PATH: found ...; expected .... Fix.`` on stderr, nothing on stdout,
nothing written. Bad usage (a missing argument) stays argparse's exit code 2.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers.cli import run_cli
from _helpers.paths import FIXTURES

from fp8state.cli import EXIT_FP8STATE_ERROR, inspect_cmd, main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Paths:
    """A TE checkpoint file, a plain folder, a DCP folder, and paths where nothing is."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.file = root / "te.pt"
        shutil.copyfile(FIXTURES / "te_legacy" / "te_E08_v2.3_cpu_pickle.pt", self.file)
        self.folder = root / "folder"
        self.folder.mkdir()
        self.dcp = root / "dcp"
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(self.dcp), no_dist=True)
        self.missing = root / "missing.pt"
        self.out = root / "out.pt"
        self.out_in_missing_folder = root / "no_such_folder" / "out.pt"


# (argv, the path the error names, what the line says after "found")
Case = Callable[[Paths], tuple[list[Path | str], Path | str, list[str]]]
CASES: dict[str, Case] = {
    "migrate-missing-src": lambda p: (
        ["migrate", p.missing, p.out],
        p.missing,
        ["found no such file or folder; expected a TE checkpoint file written by torch.save."],
    ),
    "migrate-src-folder": lambda p: (
        ["migrate", p.folder, p.out],
        p.folder,
        ["found a folder; expected a TE checkpoint file", "Pass the checkpoint file itself."],
    ),
    "migrate-src-dcp-folder": lambda p: (
        ["migrate", p.dcp, p.out],
        p.dcp,
        [
            "found a torch.distributed.checkpoint (DCP) folder; expected a TE checkpoint file",
            f"`fp8state consolidate {p.dcp} OUT.pt`",
            f"`fp8state inspect {p.dcp}` reads the folder",
        ],
    ),
    "migrate-dst-folder": lambda p: (
        ["migrate", p.file, p.folder],
        p.folder,
        ["found a folder; expected a file path such as model.pt."],
    ),
    "migrate-dst-in-missing-folder": lambda p: (
        ["migrate", p.file, p.out_in_missing_folder],
        p.out_in_missing_folder,
        ["found a path in a folder that does not exist", f"Create {p.root}/no_such_folder first"],
    ),
    "consolidate-missing-dir": lambda p: (
        ["consolidate", p.missing, p.out],
        p.missing,
        ["found no such file or folder; expected a torch.distributed.checkpoint (DCP) folder"],
    ),
    "consolidate-dir-is-a-file": lambda p: (
        ["consolidate", p.file, p.out],
        p.file,
        ["found a file; expected a torch.distributed.checkpoint (DCP) folder, holding .metadata"],
    ),
    "consolidate-out-folder": lambda p: (
        ["consolidate", p.dcp, p.folder],
        p.folder,
        ["found a folder; expected a file path"],
    ),
    "consolidate-out-in-missing-folder": lambda p: (
        ["consolidate", p.dcp, p.out_in_missing_folder],
        p.out_in_missing_folder,
        ["found a path in a folder that does not exist"],
    ),
    "inspect-missing": lambda p: (
        ["inspect", p.missing],
        p.missing,
        ["found no such file or folder; expected a torch.save file, a DCP folder or an FP8"],
    ),
    "demo-plot-folder": lambda p: (
        ["demo", "--steps", "4", "--no-progress", "--plot", p.folder],
        "--plot",
        [f"found {p.folder}, a folder; expected a file path such as demo.png"],
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_path_of_the_wrong_kind_is_one_line(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, named, says = case(Paths(tmp_path))
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run_cli(capsys, *map(str, argv))
    command = str(argv[0])
    assert code == EXIT_FP8STATE_ERROR and out == ""  # nothing converted, trained or printed
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"fp8state {command}: error: {named}: ")
    assert all(s in err for s in says), err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_an_os_error_is_path_and_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the checks cannot see coming (permissions, a full disk) reads the same way."""
    path = tmp_path / "ckpt.pt"

    def denied(source: str) -> None:
        raise PermissionError(13, "Permission denied", source)

    monkeypatch.setattr(inspect_cmd, "_summarize", denied)
    path.write_bytes(b"")
    code, out, err = run_cli(capsys, "inspect", str(path))
    assert code == EXIT_FP8STATE_ERROR and out == ""
    assert err == f"fp8state inspect: error: {path}: Permission denied\n"


def test_a_missing_argument_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["migrate", "only_src.pt"])
    assert info.value.code == 2
    assert "the following arguments are required: DST" in capsys.readouterr().err
