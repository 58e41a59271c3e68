"""The demo behind ``fp8state demo``: train in FP8, checkpoint mid-way, resume, compare bitwise.

A small model (residual LayerNormMLP blocks and a Linear head) learns a synthetic regression
task under ``fp8_autocast``. The run saves model and optimizer with ``torch.save`` half-way;
a fresh model (on a second GPU when there is one) loads that file with
``torch.load(weights_only=True)`` and trains the second half again. The two loss curves of the
second half must be equal bit for bit: everything that affects the numbers, FP8 scaling
metadata included, is in the checkpoint. The scales of a few slots are recorded after every
step of both runs (:data:`TRACED_SLOTS`), so ``fp8state demo --plot`` can draw them.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8state.autocast import fp8_autocast
from fp8state.errors import ConfigError
from fp8state.mixin import FP8StateMixin
from fp8state.modules import LayerNormMLP, Linear
from fp8state.recipe import DelayedScaling
from fp8state.slots import BwdSlot, Direction, FwdSlot, bwd_slot, fwd_slot

__all__ = [
    "DemoConfig",
    "DemoModel",
    "DemoResult",
    "run_demo",
    "train_steps",
    "pick_devices",
    "TRACED_SLOTS",
    "ScaleTrace",
]

#: Slots whose scale the demo records after every step: label -> (module, direction, slot).
#: An activation, a weight and a gradient, so the plot shows all three kinds moving.
TRACED_SLOTS: dict[str, tuple[str, Direction, int]] = {
    "block 0 fc1 input": ("blocks.0", "fwd", fwd_slot(0, FwdSlot.INPUT)),
    "block 0 fc2 input": ("blocks.0", "fwd", fwd_slot(1, FwdSlot.INPUT)),
    "head weight": ("head", "fwd", fwd_slot(0, FwdSlot.WEIGHT)),
    "head grad_output": ("head", "bwd", bwd_slot(0, BwdSlot.GRAD_OUTPUT)),
}


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and schedule of the demo (defaults run in seconds on a CPU)."""

    steps: int = 200
    hidden: int = 64
    ffn: int = 256
    blocks: int = 2
    out_dim: int = 16
    batch: int = 64
    lr: float = 3e-3
    seed: int = 0
    recipe: DelayedScaling = field(default_factory=lambda: DelayedScaling(amax_history_len=16))


class DemoModel(nn.Module):
    """Residual LayerNormMLP blocks followed by a Linear head."""

    def __init__(self, cfg: DemoConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            LayerNormMLP(cfg.hidden, cfg.ffn, device=device) for _ in range(cfg.blocks)
        )
        self.head = Linear(cfg.hidden, cfg.out_dim, device=device)
        for module in [*self.blocks, self.head]:
            # The demo's GEMMs are tiny; on a GPU they would fall back to high precision,
            # which is not what a demo of FP8 training should show.
            module.fp8_min_gemm_macs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Blocks with residual connections, then the head."""
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _batch(cfg: DemoConfig, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, the same on every device and in every run (seeded by step)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    teacher = torch.Generator().manual_seed(cfg.seed)
    proj = torch.randn(cfg.hidden, cfg.out_dim, generator=teacher) / cfg.hidden**0.5
    x = torch.randn(cfg.batch, cfg.hidden, generator=gen)
    y = torch.tanh(2 * x @ proj)
    return x.to(device), y.to(device)


def build(cfg: DemoConfig, device: torch.device) -> tuple[DemoModel, torch.optim.Optimizer]:
    """A freshly initialized model and its optimizer on ``device``."""
    torch.manual_seed(cfg.seed)
    model = DemoModel(cfg).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def train_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    cfg: DemoConfig,
    steps: range,
    device: torch.device,
    on_step: Callable[[int, float], None] | None = None,
    fp8: bool = True,
) -> list[float]:
    """Train over ``steps`` (global step numbers) and return the losses.

    ``fp8=False`` trains the same model in high precision (the reference curve).
    """
    losses = []
    for step in steps:
        x, y = _batch(cfg, step, device)
        with fp8_autocast(enabled=fp8, fp8_recipe=cfg.recipe):
            pred = model(x)
        loss = torch.nn.functional.mse_loss(pred.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


class ScaleTrace:
    """Records the scales of :data:`TRACED_SLOTS` of one model after each training step."""

    def __init__(self, model: nn.Module) -> None:
        self._cells: list[tuple[FP8StateMixin, Direction, int]] = []
        for module_name, direction, slot in TRACED_SLOTS.values():
            module = model.get_submodule(module_name)
            assert isinstance(module, FP8StateMixin)  # DemoModel's layout
            self._cells.append((module, direction, slot))
        self.values: dict[str, list[float]] = {label: [] for label in TRACED_SLOTS}

    def record(self) -> None:
        """Append the current scales (one device-to-host copy for all slots)."""
        scales = torch.stack([m.fp8_meta(d).scale[slot] for m, d, slot in self._cells])
        for label, value in zip(self.values, scales.tolist(), strict=True):
            self.values[label].append(value)


def _usable_device(option: str, spec: str) -> torch.device:
    """``spec`` as a device, checked to be one this machine can run the demo on."""
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(
            option,
            repr(spec),
            "a device name such as cpu, cuda or cuda:1",
            f"Pass {option} cpu, or leave {option} out for the default.",
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            option,
            f"{spec} (device type {device.type})",
            "cpu or cuda[:N]",
            f"The demo runs on the CPU or an NVIDIA GPU: pass {option} cpu.",
        )
    if device.type == "cpu":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        why = (
            "this PyTorch build has no CUDA support"
            if torch.version.cuda is None
            else "torch.cuda.is_available() is False (no GPU visible)"
        )
        raise ConfigError(
            option,
            f"{spec}, but {why}",
            "a device this machine has: cpu",
            f"Pass {option} cpu, or leave {option} out for the default (a GPU only if there "
            "is one).",
        )
    if (device.index or 0) >= count:
        raise ConfigError(
            option,
            f"{spec}, but this machine has {count} GPU(s)",
            f"cuda:0 to cuda:{count - 1}, or cpu",
            f"Pass one of those as {option}.",
        )
    return device


def pick_devices(
    device: str | None = None, resume_device: str | None = None
) -> tuple[torch.device, torch.device]:
    """Training device (a GPU when there is one) and resume device (another GPU if any).

    Raises:
        ConfigError: ``device`` or ``resume_device`` (the ``--device`` and ``--resume-device``
            options) is not a device name, neither cpu nor cuda, or a GPU this machine lacks.
    """
    if device is not None:
        train = _usable_device("--device", device)
    else:
        train = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if resume_device is not None:
        return train, _usable_device("--resume-device", resume_device)
    if train.type == "cuda" and torch.cuda.device_count() > 1:
        index = train.index or 0
        return train, torch.device(f"cuda:{(index + 1) % torch.cuda.device_count()}")
    return train, train


@dataclass
class DemoResult:
    """What the demo measured."""

    train_device: str
    resume_device: str
    backend: str
    steps_per_s: float
    losses: list[float]
    resumed_losses: list[float]
    checkpoint_bytes: int
    scales: dict[str, list[float]]
    #: Scale of each :data:`TRACED_SLOTS` slot after every step of the uninterrupted run.
    scale_trace: dict[str, list[float]] = field(default_factory=dict)
    #: The same for the resumed run (its steps only, from the checkpoint on).
    resumed_scale_trace: dict[str, list[float]] = field(default_factory=dict)

    @property
    def checkpoint_step(self) -> int:
        """Global step at which the resumed run starts (the checkpoint was taken before it)."""
        return len(self.losses) - len(self.resumed_losses)

    @property
    def resume_exact(self) -> bool:
        """The resumed losses and traced scales equal the uninterrupted ones bit for bit."""
        half = self.checkpoint_step
        return self.losses[half:] == self.resumed_losses and all(
            self.scale_trace[label][half:] == values
            for label, values in self.resumed_scale_trace.items()
        )


def run_demo(
    cfg: DemoConfig,
    device: torch.device,
    resume_device: torch.device,
    progress: Callable[[int, float], None] | None = None,
    on_phase: Callable[[str, range], None] | None = None,
) -> DemoResult:
    """Train ``cfg.steps`` steps with a checkpoint half-way, resume it, and compare.

    Args:
        cfg: Sizes and schedule.
        device: Device of the uninterrupted run.
        resume_device: Device of the model resumed from the checkpoint.
        progress: Called as ``progress(step, loss)`` after every step of both runs.
        on_phase: Called as ``on_phase(name, steps)`` before each run: ``("train",
            range(0, cfg.steps))``, then ``("resume", range(cfg.steps // 2, cfg.steps))``.

    Returns:
        The losses, traced scales and timings of both runs.
    """
    half = cfg.steps // 2
    model, opt = build(cfg, device)
    trace = ScaleTrace(model)
    on_step = _recording(trace, progress)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        if on_phase is not None:
            on_phase("train", range(cfg.steps))
        start = time.perf_counter()
        losses = train_steps(model, opt, cfg, range(half), device, on_step)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        losses += train_steps(model, opt, cfg, range(half, cfg.steps), device, on_step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        fresh, fresh_opt = build(cfg, resume_device)
        ckpt = torch.load(path, weights_only=True, map_location="cpu")
        fresh.load_state_dict(ckpt["model"])
        fresh_opt.load_state_dict(ckpt["optimizer"])
        resumed_trace = ScaleTrace(fresh)
        if on_phase is not None:
            on_phase("resume", range(half, cfg.steps))
        resumed = train_steps(
            fresh,
            fresh_opt,
            cfg,
            range(half, cfg.steps),
            resume_device,
            _recording(resumed_trace, progress),
        )
        size = os.path.getsize(path)
    head = model.head
    return DemoResult(
        train_device=str(device),
        resume_device=str(resume_device),
        backend=head.fp8_last_gemm_backend,
        steps_per_s=cfg.steps / elapsed,
        losses=losses,
        resumed_losses=resumed,
        checkpoint_bytes=size,
        scales={
            "head fwd (input, weight)": head.fp8_meta("fwd").scale[:2].tolist(),
            "head bwd (grad_output)": head.fp8_meta("bwd").scale[:1].tolist(),
        },
        scale_trace=trace.values,
        resumed_scale_trace=resumed_trace.values,
    )


def _recording(
    trace: ScaleTrace, progress: Callable[[int, float], None] | None
) -> Callable[[int, float], None]:
    """A step callback that records the traced scales, then reports progress."""

    def on_step(step: int, loss: float) -> None:
        trace.record()
        if progress is not None:
            progress(step, loss)

    return on_step
