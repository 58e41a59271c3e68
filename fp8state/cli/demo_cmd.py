"""``fp8state demo``: the main job. Train in FP8, checkpoint, resume, prove the resume exact."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from fp8state.cli._demo.plot import check_plot_path, plot_demo
from fp8state.cli._demo.training import DemoConfig, pick_devices, run_demo

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
        "--resume-device",
        default=None,
        help="device of the resumed model (default: another GPU if there is one)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show or hide the progress bars on stderr (default: shown only when stderr is a "
        "terminal, so logs and pipes get no carriage-return updates)",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="also write a PNG of both loss curves and the scales of a few FP8 slots per step, "
        "replacing PATH if it exists (needs matplotlib: pip install 'fp8state[plot]')",
    )


class _PhaseBars:
    """One progress bar per run of the demo, each counting that run's steps.

    The uninterrupted run counts ``--steps`` steps; the run resumed from the checkpoint counts
    the second half again, on a bar of its own labelled as such.
    """

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._bar: tqdm[None] | None = None

    def start(self, phase: str, steps: range) -> None:
        """Close the previous bar and open one for ``steps`` of ``phase``."""
        self.close()
        label = {"train": "train", "resume": "resumed from checkpoint"}.get(phase, phase)
        self._bar = tqdm(
            total=len(steps),
            unit="step",
            disable=not self._enabled,
            desc=f"{label}, steps {steps.start}-{steps.stop - 1}",
        )

    def step(self, step: int, loss: float) -> None:
        """Count one step of the current run."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}")
            self._bar.update(1)

    def close(self) -> None:
        """Close the current bar, if any."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its summary; exit 0 only if the resume was exact."""
    if args.steps < 2:
        print("fp8state demo: error: --steps must be at least 2", file=sys.stderr)
        return 2
    # Before training: a missing matplotlib or a bad path must not cost the whole run.
    plot_path = check_plot_path(args.plot) if args.plot is not None else None
    cfg = DemoConfig(steps=args.steps, seed=args.seed)
    device, resume_device = pick_devices(args.device, args.resume_device)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    bars = _PhaseBars(enabled=show)
    try:
        result = run_demo(cfg, device, resume_device, bars.step, bars.start)
    finally:
        bars.close()
    half = cfg.steps // 2
    print("fp8state demo summary")
    print(f"  devices        train {result.train_device}, resume {result.resume_device}")
    print(f"  GEMM backend   {result.backend}")
    print(f"  speed          {result.steps_per_s:.1f} steps/s (training, {cfg.steps} steps)")
    print(
        f"  loss           step 0 {result.losses[0]:.5f} -> step {cfg.steps - 1} "
        f"{result.losses[-1]:.5f}"
    )
    print(
        f"  checkpoint     step {half}, {result.checkpoint_bytes / 1024:.0f} KiB, "
        "loaded with torch.load(weights_only=True)"
    )
    for name, values in result.scales.items():
        print(f"  scale {name:<26} " + ", ".join(f"{v:.4g}" for v in values))
    if plot_path is not None:
        print(f"  plot           {plot_demo(result, plot_path)}")
    if result.resume_exact:
        print(
            f"  resume         exact: steps {half}-{cfg.steps - 1} match bit for bit "
            f"({len(result.resumed_losses)} losses)"
        )
        return 0
    diffs = [
        i + half
        for i, (a, b) in enumerate(zip(result.losses[half:], result.resumed_losses, strict=True))
        if a != b
    ]
    print(f"  resume         MISMATCH at steps {diffs}", file=sys.stderr)
    return EXIT_RESUME_MISMATCH
