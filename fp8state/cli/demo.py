"""``fp8state demo``: the main job. Train in FP8, checkpoint, resume, prove the resume exact."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from fp8state.demo import DemoConfig, pick_devices, run_demo
from fp8state.plot import check_plot_path, plot_demo

NAME = "demo"
HELP = "Train a small FP8 model, checkpoint half-way, resume in a fresh model, compare bitwise."

#: Exit code when the resumed loss curve differs from the uninterrupted one.
EXIT_RESUME_MISMATCH = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fp8state demo``."""
    parser.add_argument("--steps", type=int, default=DemoConfig.steps, help="training steps")
    parser.add_argument("--seed", type=int, default=DemoConfig.seed)
    parser.add_argument("--device", default=None, help="training device (default: cuda:0 or cpu)")
    parser.add_argument(
        "--resume-device", default=None,
        help="device of the resumed model (default: another GPU if there is one)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--plot", metavar="PATH", default=None,
        help="also write a PNG of both loss curves and the scales of a few FP8 slots per step "
             "(needs matplotlib: pip install 'fp8state[plot]')",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its summary; exit 0 only if the resume was exact."""
    if args.steps < 2:
        print("fp8state demo: error: --steps must be at least 2", file=sys.stderr)
        return 2
    # Before training: a missing matplotlib or a bad path must not cost the whole run.
    plot_path = check_plot_path(args.plot) if args.plot is not None else None
    cfg = DemoConfig(steps=args.steps, seed=args.seed)
    device, resume_device = pick_devices(args.device, args.resume_device)
    total = cfg.steps + cfg.steps // 2
    with tqdm(total=total, desc="fp8state demo", unit="step", disable=args.no_progress) as bar:
        def progress(step: int, loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.update(1)

        result = run_demo(cfg, device, resume_device, progress)
    half = cfg.steps // 2
    print("fp8state demo summary")
    print(f"  devices        train {result.train_device}, resume {result.resume_device}")
    print(f"  GEMM backend   {result.backend}")
    print(f"  speed          {result.steps_per_s:.1f} steps/s (training, {cfg.steps} steps)")
    print(f"  loss           step 0 {result.losses[0]:.5f} -> step {cfg.steps - 1} "
          f"{result.losses[-1]:.5f}")
    print(f"  checkpoint     step {half}, {result.checkpoint_bytes / 1024:.0f} KiB, "
          "loaded with torch.load(weights_only=True)")
    for name, values in result.scales.items():
        print(f"  scale {name:<26} " + ", ".join(f"{v:.4g}" for v in values))
    if plot_path is not None:
        print(f"  plot           {plot_demo(result, plot_path)}")
    if result.resume_exact:
        print(f"  resume         exact: steps {half}-{cfg.steps - 1} match bit for bit "
              f"({len(result.resumed_losses)} losses)")
        return 0
    diffs = [i + half for i, (a, b) in enumerate(
        zip(result.losses[half:], result.resumed_losses, strict=True)) if a != b]
    print(f"  resume         MISMATCH at steps {diffs}", file=sys.stderr)
    return EXIT_RESUME_MISMATCH
