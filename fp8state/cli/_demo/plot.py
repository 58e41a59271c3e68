"""Draw what ``fp8state demo`` measured: loss curves and FP8 scales, as a PNG.

matplotlib is an optional extra (``pip install 'fp8state[plot]'``), imported only when a plot is
drawn. The figure is rendered by the Agg canvas directly, without ``pyplot``: no window, no
display needed, and the caller's matplotlib backend is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8state._atomic_file import write_atomically
from fp8state.errors import ConfigError

if TYPE_CHECKING:
    from fp8state.cli._demo.training import DemoResult

__all__ = ["require_matplotlib", "check_plot_path", "plot_demo", "demo_figure", "PLOT_EXTRA"]

#: What to install for plotting.
PLOT_EXTRA = "pip install 'fp8state[plot]'"


def require_matplotlib() -> None:
    """Raise a clear error now if matplotlib is missing (before minutes of training).

    Raises:
        ConfigError: matplotlib cannot be imported.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            "--plot",
            f"no matplotlib ({err})",
            "matplotlib, the optional `plot` extra",
            f"Install it with {PLOT_EXTRA}, or drop --plot.",
        ) from None


def _check_target(path: Path) -> None:
    if path.is_dir():
        raise ConfigError(
            "--plot",
            f"{path}, a folder",
            "a file path such as demo.png",
            "Name the PNG file to write.",
        )
    if not path.parent.is_dir():
        raise ConfigError(
            "--plot",
            f"{path}, in a folder that does not exist",
            "a path in an existing folder",
            f"Create {path.parent} first.",
        )


def check_plot_path(path: str | os.PathLike[str]) -> Path:
    """Check that a PNG can be written at ``path`` and that matplotlib is there.

    Raises:
        ConfigError: matplotlib is missing, or ``path`` is a folder or in a missing one.
    """
    target = Path(path)
    require_matplotlib()
    _check_target(target)
    return target


def plot_demo(result: DemoResult, path: str | os.PathLike[str]) -> Path:
    """Write a PNG with the demo's loss curves and the scale history of its traced slots.

    Left: the loss per step of the uninterrupted run and of the run resumed from the
    checkpoint (they overlap where the resume is exact). Right: the scale of each slot of
    :data:`fp8state.cli._demo.training.TRACED_SLOTS` after every step, in both runs. In both
    panels a dotted line, named in the legend, marks the checkpoint. The file is written
    next to ``path`` and renamed into place, so ``path`` is never half-written; an existing
    file is replaced, and the file gets the mode ``open`` gives a new one (the umask's).

    Args:
        result: What :func:`fp8state.cli._demo.training.run_demo` returned.
        path: The PNG file to write.

    Returns:
        The path written.

    Raises:
        ConfigError: matplotlib is missing, or ``path`` cannot be a new file.
    """
    target = check_plot_path(path)
    fig = demo_figure(result)
    # Written beside the target, synced, then renamed: an interrupted run leaves no broken PNG.
    # A plot is redrawn by running the demo again, so an existing one is replaced.
    write_atomically(target, lambda file: fig.savefig(file, format="png"))
    return target


def demo_figure(result: DemoResult) -> Any:
    """The figure :func:`plot_demo` writes, as a ``matplotlib.figure.Figure`` on an Agg canvas.

    Raises:
        ConfigError: matplotlib is missing.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, scale_ax = fig.subplots(1, 2)
    half = result.checkpoint_step
    steps = range(len(result.losses))
    resumed_steps = range(half, half + len(result.resumed_losses))

    loss_ax.plot(steps, result.losses, color="tab:blue", lw=1.6, label="uninterrupted")
    loss_ax.plot(
        resumed_steps,
        result.resumed_losses,
        color="tab:orange",
        lw=1.2,
        ls="--",
        label="resumed from checkpoint",
    )
    verdict = "bit-identical" if result.resume_exact else "MISMATCH"
    loss_ax.set_title(f"Loss (resume {verdict})")
    _mark_checkpoint(loss_ax, half)
    _log_if_positive(loss_ax, result.losses + result.resumed_losses)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("MSE loss")
    # Upper right: the loss starts high on the left and settles low, so the corner stays clear.
    loss_ax.legend(loc="upper right", fontsize="small")

    colors = ["tab:green", "tab:purple", "tab:brown", "tab:red", "tab:cyan", "tab:olive"]
    for i, (label, values) in enumerate(result.scale_trace.items()):
        color = colors[i % len(colors)]
        scale_ax.plot(range(len(values)), values, color=color, lw=1.6, label=label)
        resumed = result.resumed_scale_trace.get(label, [])
        scale_ax.plot(range(half, half + len(resumed)), resumed, color=color, lw=1.0, ls="--")
    scale_ax.set_title("FP8 scales (solid: uninterrupted, dashed: resumed)")
    _mark_checkpoint(scale_ax, half)
    _log_if_positive(scale_ax, [v for vs in result.scale_trace.values() for v in vs])
    scale_ax.set_xlabel("step")
    scale_ax.set_ylabel("scale = fp8_max / amax")
    scale_ax.legend(loc="best", fontsize="small")

    fig.suptitle(
        f"fp8state demo: train {result.train_device}, resume {result.resume_device}, "
        f"GEMM backend {result.backend}"
    )
    return fig


def _mark_checkpoint(ax: Any, step: int) -> None:
    """A dotted line at the checkpoint, named in the panel's legend.

    In the legend, not as text beside the line: the checkpoint is half-way, which the loss
    panel's upper-right legend reaches in a short run, and floating text there would sit
    under it. Call before ``ax.legend``.
    """
    ax.axvline(step, color="gray", lw=0.8, ls=":", label=f"checkpoint (step {step})")


def _log_if_positive(ax: Any, values: list[float]) -> None:
    # Losses and scales span decades; a log axis shows them, but only takes positive values.
    if values and min(values) > 0:
        ax.set_yscale("log")
