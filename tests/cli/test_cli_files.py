"""The files ``migrate``, ``consolidate`` and ``demo --plot`` write.

An existing output is refused unless ``--overwrite`` is given (the plot, which any demo run
draws again, is replaced); a failure at any point, half-way through writing included, leaves
the destination as it was and no temporary file behind; and the file gets the mode
``torch.save`` would give it, ``0o666`` less the umask.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib.figure
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers.cli import run_cli
from _helpers.paths import FIXTURES

from fp8state.checkpoint import consolidate, consolidation
from fp8state.cli._demo.plot import plot_demo
from fp8state.cli._demo.training import DemoConfig, DemoResult, run_demo
from fp8state.errors import CheckpointError
from fp8state.migrate import writer

SRC = FIXTURES / "te_legacy" / "te_E08_v2.3_cpu_pickle.pt"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """An empty folder for the outputs alone, so a stray temporary file shows."""
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


@pytest.fixture
def dcp_folder(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    folder = tmp_path / "dcp"
    dcp.save(torch.nn.Linear(4, 4).state_dict(), checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.fixture(scope="module")
def demo_result() -> DemoResult:
    cpu = torch.device("cpu")
    return run_demo(DemoConfig(steps=4, hidden=16, ffn=32, blocks=1, batch=8), cpu, cpu)


@pytest.fixture
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The process's umask set to the parameter for the test, restored after it."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ------------------------------------------------------------------- migrate: an existing DST


def test_migrate_refuses_an_existing_dst_before_converting(
    out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = out_dir / "model.pt"
    dst.write_bytes(b"an earlier conversion")
    code, out, err = run_cli(capsys, "migrate", str(SRC), str(dst))
    assert code == 1 and out == ""  # no report: nothing was converted
    assert err == (
        f"fp8state migrate: error: {dst}: found an existing file; expected a path that does not "
        "exist yet. Choose another output path, or add --overwrite to replace it.\n"
    )
    assert dst.read_bytes() == b"an earlier conversion" and _names(out_dir) == ["model.pt"]


def test_migrate_overwrite_replaces_dst(out_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = out_dir / "model.pt"
    dst.write_bytes(b"an earlier conversion")
    code, out, _ = run_cli(capsys, "migrate", str(SRC), str(dst), "--overwrite")
    assert code == 0 and f"wrote {dst}" in out
    assert "blocks.0.mlp._extra_state" in torch.load(dst, weights_only=True)
    assert _names(out_dir) == ["model.pt"]


def test_dry_run_says_an_existing_dst_would_be_refused(
    out_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = out_dir / "model.pt"
    dst.write_bytes(b"keep")
    code, out, _ = run_cli(capsys, "migrate", str(SRC), str(dst), "--dry-run")
    assert code == 0
    assert out.splitlines()[-1] == (
        f"dry run: {dst} not written (it exists: without --overwrite, migrate would refuse it)"
    )
    code, out, _ = run_cli(capsys, "migrate", str(SRC), str(dst), "--dry-run", "--overwrite")
    assert code == 0 and out.splitlines()[-1] == f"dry run: {dst} not written"
    assert dst.read_bytes() == b"keep"


def test_migrate_never_replaces_src(out_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = out_dir / "te.pt"
    shutil.copyfile(SRC, src)
    other_spelling = out_dir / ".." / "out" / "te.pt"
    code, out, err = run_cli(capsys, "migrate", str(src), str(other_spelling), "--overwrite")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert f"{other_spelling}: found SRC itself" in err
    assert src.read_bytes() == SRC.read_bytes() and _names(out_dir) == ["te.pt"]


# ------------------------------------------------------- migrate: failures while writing


@pytest.mark.parametrize(
    "failure",
    [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
    ids=["disk-full", "interrupt"],
)
def test_a_failure_half_way_keeps_the_old_dst(
    failure: BaseException,
    out_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def half_a_save(obj: Any, file: Any) -> None:
        file.write(b"PK\x03\x04 half a checkpoint")
        raise failure

    monkeypatch.setattr(writer.torch, "save", half_a_save)
    dst = out_dir / "model.pt"
    dst.write_bytes(b"an earlier conversion")
    if isinstance(failure, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            run_cli(capsys, "migrate", str(SRC), str(dst), "--overwrite")
    else:
        code, _, err = run_cli(capsys, "migrate", str(SRC), str(dst), "--overwrite")
        assert code == 1 and err.count("\n") == 1 and "No space left on device" in err
    assert dst.read_bytes() == b"an earlier conversion" and _names(out_dir) == ["model.pt"]


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_a_dst_that_appears_while_writing_is_not_replaced(
    links: bool,
    out_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dst = out_dir / "model.pt"
    real_save = torch.save

    def save_while_another_run_finishes(obj: Any, file: Any) -> None:
        dst.write_bytes(b"another run's result")
        real_save(obj, file)

    monkeypatch.setattr(writer.torch, "save", save_while_another_run_finishes)
    if not links:  # a file system without hard links (FAT, some network mounts)
        monkeypatch.setattr(os, "link", _no_link)
    code, out, err = run_cli(capsys, "migrate", str(SRC), str(dst))
    assert code == 1 and "wrote" not in out
    assert err.count("\n") == 1 and f"{dst}: found an existing file" in err and "--overwrite" in err
    assert dst.read_bytes() == b"another run's result" and _names(out_dir) == ["model.pt"]


def _no_link(src: Any, dst: Any) -> None:
    raise OSError(errno.EPERM, "Operation not permitted", src)


def test_without_hard_links_a_new_dst_is_still_written(
    out_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "link", _no_link)
    code, _, err = run_cli(capsys, "migrate", str(SRC), str(out_dir / "model.pt"))
    assert code == 0, err
    assert "blocks.0.mlp._extra_state" in torch.load(out_dir / "model.pt", weights_only=True)
    assert _names(out_dir) == ["model.pt"]


def test_migrate_syncs_the_file_and_its_folder(
    out_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert run_cli(capsys, "migrate", str(SRC), str(out_dir / "model.pt"))[0] == 0
    assert synced == ["file", "folder"]  # the content before the rename, the new name after


# ----------------------------------------------------------------------------- consolidate


def test_consolidate_failure_half_way_keeps_the_old_out(
    dcp_folder: Path,
    out_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def half_a_save(obj: Any, file: Any) -> None:
        file.write(b"PK\x03\x04 half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(consolidation.torch, "save", half_a_save)
    out = out_dir / "one.pt"
    out.write_bytes(b"an earlier file")
    code, _, err = run_cli(capsys, "consolidate", str(dcp_folder), str(out), "--overwrite")
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err
    assert out.read_bytes() == b"an earlier file" and _names(out_dir) == ["one.pt"]


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_consolidate_never_replaces_an_out_that_appears_while_writing(
    links: bool, dcp_folder: Path, out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = out_dir / "one.pt"
    real_save = torch.save

    def save_while_another_run_finishes(obj: Any, file: Any) -> None:
        out.write_bytes(b"another run's result")
        real_save(obj, file)

    monkeypatch.setattr(consolidation.torch, "save", save_while_another_run_finishes)
    if not links:
        monkeypatch.setattr(os, "link", _no_link)
    with pytest.raises(CheckpointError, match="an existing file"):
        consolidate(dcp_folder, out)
    assert out.read_bytes() == b"another run's result" and _names(out_dir) == ["one.pt"]


# ------------------------------------------------------------------------------------ plot


def test_plot_failure_half_way_keeps_the_old_png(
    demo_result: DemoResult, out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_a_png(self: Any, file: Any, **kwargs: Any) -> None:
        if isinstance(file, (str, os.PathLike)):  # savefig takes a path or a file object
            Path(file).write_bytes(PNG_MAGIC)
        else:
            file.write(PNG_MAGIC)
        raise OSError(errno.ENOSPC, "No space left on device")

    png = out_dir / "demo.png"
    png.write_bytes(b"an earlier plot")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_a_png)
    with pytest.raises(OSError, match="No space left"):
        plot_demo(demo_result, png)
    assert png.read_bytes() == b"an earlier plot" and _names(out_dir) == ["demo.png"]


def test_plot_replaces_an_existing_png(demo_result: DemoResult, out_dir: Path) -> None:
    png = out_dir / "demo.png"
    png.write_bytes(b"an earlier plot")
    plot_demo(demo_result, png)
    assert png.read_bytes()[:8] == PNG_MAGIC and _names(out_dir) == ["demo.png"]


# ------------------------------------------------------------------- modes follow the umask


@pytest.mark.parametrize(
    ("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)], indirect=["umask"]
)
def test_written_files_get_the_umask_mode(
    umask: int,
    mode: int,
    dcp_folder: Path,
    out_dir: Path,
    demo_result: DemoResult,
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch.save({"w": torch.ones(1)}, out_dir / "by_torch_save.pt")
    assert _mode(out_dir / "by_torch_save.pt") == mode  # what every tool here must match
    assert run_cli(capsys, "migrate", str(SRC), str(out_dir / "migrated.pt"))[0] == 0
    assert run_cli(capsys, "consolidate", str(dcp_folder), str(out_dir / "one.pt"))[0] == 0
    plot_demo(demo_result, out_dir / "demo.png")
    written = ["by_torch_save.pt", "demo.png", "migrated.pt", "one.pt"]
    assert _names(out_dir) == written
    assert {name: _mode(out_dir / name) for name in written} == dict.fromkeys(written, mode)
