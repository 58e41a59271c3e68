"""``fp8state demo --plot``: the recorded series are right and the PNG is a real image."""

from __future__ import annotations

import dataclasses
import struct
import sys

import pytest
import torch

from fp8state.cli import main
from fp8state.cli._demo.plot import demo_figure, plot_demo
from fp8state.cli._demo.training import TRACED_SLOTS, DemoConfig, build, run_demo, train_steps
from fp8state.errors import ConfigError

CPU = torch.device("cpu")
SMALL = DemoConfig(steps=6, hidden=16, ffn=32, blocks=1, batch=8)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result():
    return run_demo(SMALL, CPU, CPU)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"  # the first chunk, always
    return struct.unpack(">II", data[16:24])


def test_traces_hold_the_scales_after_every_step(result) -> None:
    half = SMALL.steps // 2
    assert list(result.scale_trace) == list(TRACED_SLOTS)
    # Independently: train the same model step by step and read the scales after each step.
    model, opt = build(SMALL, CPU)
    expected: dict[str, list[float]] = {label: [] for label in TRACED_SLOTS}

    def read(step: int, loss: float) -> None:
        for label, (module, direction, slot) in TRACED_SLOTS.items():
            scale = model.get_submodule(module).fp8_meta(direction).scale[slot]
            expected[label].append(float(scale))

    losses = train_steps(model, opt, SMALL, range(SMALL.steps), CPU, read)
    assert losses == result.losses
    assert result.scale_trace == expected
    assert all(len(v) == SMALL.steps - half for v in result.resumed_scale_trace.values())
    assert {k: v[half:] for k, v in expected.items()} == result.resumed_scale_trace
    assert result.resume_exact and result.checkpoint_step == half
    # The scales moved during training (the plot would otherwise show flat lines at 1).
    assert all(len(set(v)) > 1 for v in result.scale_trace.values())


def test_a_differing_resumed_scale_is_a_mismatch(result) -> None:
    label = next(iter(TRACED_SLOTS))
    changed = {
        **result.resumed_scale_trace,
        label: [v * 2 for v in result.resumed_scale_trace[label]],
    }
    assert not dataclasses.replace(result, resumed_scale_trace=changed).resume_exact


def test_plot_writes_a_png(result, tmp_path) -> None:
    path = tmp_path / "demo.png"
    assert plot_demo(result, path) == path
    data = path.read_bytes()
    assert _png_size(data) == (1210, 462)  # figsize (11, 4.2) inches at 110 dpi
    assert len(data) > 20_000  # two panels of curves, not an empty canvas
    assert [p.name for p in tmp_path.iterdir()] == ["demo.png"]  # no temporary file left


def test_plot_refuses_a_folder_or_a_missing_folder(result, tmp_path) -> None:
    with pytest.raises(ConfigError, match="a folder"):
        plot_demo(result, tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        plot_demo(result, tmp_path / "missing" / "demo.png")


def test_cli_demo_plot(tmp_path, capsys) -> None:
    path = tmp_path / "curves.png"
    assert main(["demo", "--steps", "4", "--no-progress", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"plot           {path}" in out and "resume         exact" in out
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_cli_without_matplotlib_fails_at_once_with_the_install_line(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    code = main(["demo", "--steps", "4", "--no-progress", "--plot", str(tmp_path / "x.png")])
    captured = capsys.readouterr()
    assert code == 1
    assert "fp8state demo summary" not in captured.out  # nothing trained
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "pip install 'fp8state[plot]'" in lines[0]
    assert not (tmp_path / "x.png").exists()


def test_the_checkpoint_is_named_in_each_legend_not_under_it(result) -> None:
    fig = demo_figure(result)
    fig.canvas.draw()
    half = result.checkpoint_step
    for ax in fig.axes:
        legend = ax.get_legend()
        entries = [t.get_text() for t in legend.get_texts()]
        assert f"checkpoint (step {half})" in entries
        (line,) = [h for h in legend.legend_handles if h.get_label().startswith("checkpoint")]
        assert line.get_linestyle() == ":"
        # The marked line is at the checkpoint; no loose text a legend could cover.
        (marker,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("checkpoint")]
        assert list(marker.get_xdata()) == [half, half]
        assert not ax.texts
