"""Training in FP8: convergence against fp32, exact resume, and the `fp8state demo` job."""

from __future__ import annotations

import statistics

import torch
from _helpers.cli import run_console
from _helpers.models import save_load
from _helpers.state import assert_state_equal

from fp8state.backends import resolve_backend
from fp8state.cli import main
from fp8state.cli._demo.training import DemoConfig, build, pick_devices, train_steps

CPU = torch.device("cpu")


def test_fp8_loss_within_25_percent_of_fp32_over_3_seeds() -> None:
    ratios = []
    for seed in range(3):
        cfg = DemoConfig(steps=100, seed=seed, hidden=32, ffn=64, blocks=1, batch=32)
        model, opt = build(cfg, CPU)
        fp8_loss = train_steps(model, opt, cfg, range(cfg.steps), CPU)[-1]
        model, opt = build(cfg, CPU)
        fp32_loss = train_steps(model, opt, cfg, range(cfg.steps), CPU, fp8=False)[-1]
        ratios.append(fp8_loss / fp32_loss)
    assert abs(statistics.median(ratios) - 1) <= 0.25, ratios


def test_resume_is_bitwise_exact() -> None:
    cfg = DemoConfig(steps=20, hidden=32, ffn=64, blocks=2, batch=16)
    straight_model, opt = build(cfg, CPU)
    straight = train_steps(straight_model, opt, cfg, range(20), CPU)

    model, opt = build(cfg, CPU)
    first = train_steps(model, opt, cfg, range(10), CPU)
    ckpt = save_load({"model": model.state_dict(), "optimizer": opt.state_dict()})
    fresh, fresh_opt = build(cfg, CPU)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["optimizer"])
    resumed = train_steps(fresh, fresh_opt, cfg, range(10, 20), CPU)
    assert first == straight[:10]
    assert resumed == straight[10:]  # float equality: bit for bit
    assert_state_equal(straight_model, fresh)


def test_resume_without_fp8_metadata_differs() -> None:
    """The metadata matters: dropping it from the checkpoint changes the resumed curve."""
    cfg = DemoConfig(steps=12, hidden=32, ffn=64, blocks=1, batch=16)
    model, opt = build(cfg, CPU)
    straight = train_steps(model, opt, cfg, range(12), CPU)
    model, opt = build(cfg, CPU)
    train_steps(model, opt, cfg, range(6), CPU)
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    fresh, fresh_opt = build(cfg, CPU)
    fresh.load_state_dict(weights, strict=False)
    fresh_opt.load_state_dict(opt.state_dict())
    assert train_steps(fresh, fresh_opt, cfg, range(6, 12), CPU) != straight[6:]


def test_demo_command_proves_exact_resume(capsys) -> None:
    assert main(["demo", "--steps", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    device = pick_devices()[0]
    backend = resolve_backend("auto", device)  # the demo forces FP8 even for its tiny GEMMs
    assert "resume         exact" in out and f"GEMM backend   {backend}" in out


def test_demo_console_script_runs() -> None:
    proc = run_console("demo", "--steps", "4", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "fp8state demo summary" in proc.stdout
