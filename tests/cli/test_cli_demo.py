"""``fp8state demo``: progress bars that count what the summary counts, and device errors."""

from __future__ import annotations

import re

import pytest
import torch
from _helpers.cli import Terminal

from fp8state.cli import main
from fp8state.cli._demo.training import DemoConfig, run_demo

CPU = torch.device("cpu")


def _bar_totals(err: str) -> dict[str, str]:
    """Each bar's description -> its last ``n/total`` count."""
    last: dict[str, str] = {}
    for desc, count in re.findall(r"([a-z][a-z ]*, steps \d+-\d+):\s+\d+%\|[^|]*\| (\d+/\d+)", err):
        last[desc] = count
    return last


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys) -> None:
    assert main(["demo", "--steps", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # a log or a pipe gets no carriage-return updates
    assert "resume         exact" in captured.out


@pytest.mark.parametrize("argv", [["--progress"], []], ids=["asked", "terminal"])
def test_bars_count_the_training_steps_then_the_resumed_half(argv, monkeypatch, capsys) -> None:
    terminal = Terminal()
    if not argv:
        monkeypatch.setattr("sys.stderr", terminal)
    assert main(["demo", "--steps", "6", *argv]) == 0
    err = terminal.getvalue() if not argv else capsys.readouterr().err
    assert "\r" in err
    # One bar per run: 6 training steps (as the summary's "6 steps"), then the 3 resumed ones.
    assert _bar_totals(err) == {
        "train, steps 0-5": "6/6",
        "resumed from checkpoint, steps 3-5": "3/3",
    }


def test_no_progress_hides_the_bars_even_on_a_terminal(monkeypatch, capsys) -> None:
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["demo", "--steps", "4", "--no-progress"]) == 0
    assert terminal.getvalue() == ""
    assert "fp8state demo summary" in capsys.readouterr().out


def test_run_demo_announces_each_run_before_its_steps() -> None:
    events: list[tuple] = []
    run_demo(
        DemoConfig(steps=6, hidden=16, ffn=32, blocks=1, batch=8),
        CPU,
        CPU,
        progress=lambda step, loss: events.append(("step", step)),
        on_phase=lambda name, steps: events.append((name, steps)),
    )
    assert events == [
        ("train", range(6)),
        *[("step", s) for s in range(6)],
        ("resume", range(3, 6)),
        *[("step", s) for s in range(3, 6)],
    ]


def _no_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "fp8state demo summary" not in captured.out  # nothing trained
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_on_a_machine_without_cuda_is_a_one_line_error(device, monkeypatch, capsys) -> None:
    _no_cuda(monkeypatch)
    assert main(["demo", "--steps", "4", "--device", device]) == 1
    line = _one_line_error(capsys)
    assert line.startswith(f"fp8state demo: error: --device: found {device}, but ")
    assert "Pass --device cpu, or leave --device out" in line


def test_a_gpu_the_machine_lacks_names_the_ones_it_has(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["demo", "--steps", "4", "--device", "cpu", "--resume-device", "cuda:2"]) == 1
    line = _one_line_error(capsys)
    assert "--resume-device: found cuda:2, but this machine has 2 GPU(s)" in line
    assert "cuda:0 to cuda:1" in line


@pytest.mark.parametrize(
    ("device", "found"),
    [
        ("gpu0", "found 'gpu0'; expected a device name"),
        ("mps", "found mps (device type mps)"),
        ("meta", "found meta (device type meta)"),
    ],
)
def test_unusable_device_names_are_one_line_errors(device, found, capsys) -> None:
    assert main(["demo", "--steps", "4", "--device", device]) == 1
    line = _one_line_error(capsys)
    assert line.startswith(f"fp8state demo: error: --device: {found}")
    assert "--device cpu" in line
