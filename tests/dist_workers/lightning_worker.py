"""Training runs through Lightning with fp8state's precision plugins, in one process or per rank.

tests/integrations/test_lightning.py calls the run functions directly (one process) and runs
this file under ``torchrun --standalone --nproc-per-node 2`` for DDP over gloo, one phase per
launch, so that a resumed run starts in fresh processes:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/dist_workers/lightning_worker.py {train|resume} OUT

Phases: ``full`` trains every step; ``first`` trains the first steps and saves a checkpoint
under OUT; ``resume`` (Trainer: ``resume-saved`` or ``resume-epoch``, from
``trainer.save_checkpoint``'s file or ModelCheckpoint's) loads it into new objects and trains
the rest. The ``train`` launch runs the first two phases with Fabric and with the Trainer, the
``resume`` launch the resumes; each rank writes the :func:`outcome` of each run to
``OUT/<stack>-<phase>-rank<r>.pt``.

Everything is deterministic: the weights come from a seed, each batch from its step and rank.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import fp8state
from fp8state.integrations.lightning import FabricFP8Precision, TrainerFP8Precision

HIDDEN, BATCH = 32, 8
#: Trainer runs: epochs of two batches per rank; "first" stops after FIRST_EPOCHS.
EPOCHS, FIRST_EPOCHS, BATCHES_PER_EPOCH = 3, 2, 2
#: Fabric runs: optimizer steps; "first" stops after FIRST_STEPS.
STEPS, FIRST_STEPS = 6, 4
#: The norm -> linear pair of :func:`plain_net` the plugins fuse into one LayerNormLinear.
PAIR = ("0", "1")

warnings.filterwarnings("ignore", ".*does not have many workers.*")  # tiny in-memory data


def plain_net(seed: int = 0) -> nn.Module:
    """A tiny net: plain layers the plugin converts, and one fp8state module built as such."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.LayerNorm(HIDDEN),  # fused with the next layer into one LayerNormLinear
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        fp8state.LayerNormMLP(HIDDEN, 2 * HIDDEN),  # an fp8state module from the start
        nn.Linear(HIDDEN, HIDDEN),
    )


def batch(step: int, rank: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, HIDDEN, generator=gen) * (1 + step % 3)


def plugin_options(prefix: str = "") -> dict[str, Any]:
    """Fuse :data:`PAIR` (its names under ``prefix``); every GEMM in FP8, however small."""
    return {"layernorm_linear": [tuple(prefix + n for n in PAIR)], "fp8_min_gemm_macs": 0}


def outcome(model: nn.Module, losses: list[float]) -> dict[str, Any]:
    """What a run leaves: its losses, every parameter, every FP8 module's live metadata."""
    meta: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, fp8state.FP8StateMixin):
            meta[name] = {
                "recipe": module.fp8_recipe.to_scalars(),
                **{d: [t.clone() for t in module.fp8_meta(d)] for d in ("fwd", "bwd")},
            }
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": torch.tensor(losses, dtype=torch.float64), "params": params, "meta": meta}


# ------------------------------------------------------------------------------------ Fabric
def fabric_run(phase: str, folder: Path, strategy: str = "auto", devices: int = 1) -> dict:
    """``full``: STEPS steps. ``first``: FIRST_STEPS, then ``fabric.save``. ``resume``: new
    Fabric, model and optimizer, ``fabric.load``, the remaining steps."""
    fabric = Fabric(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=FabricFP8Precision(**plugin_options()),
    )
    fabric.launch()
    net = plain_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(net, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    path = folder / "fabric.ckpt"
    if phase == "resume":
        fabric.load(path, state)
    stop = FIRST_STEPS if phase == "first" else STEPS
    losses = []
    for step in range(state["step"], stop):
        loss = model(batch(step, fabric.global_rank)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if phase == "first":
        state["step"] = stop
        fabric.save(path, state)
    return outcome(net, losses)


# ----------------------------------------------------------------------------------- Trainer
class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = plain_net()
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        loss = self.net(batch[0]).square().mean()
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(world: int = 1) -> torch.utils.data.DataLoader:
    """The same samples every epoch, in order (each rank takes its share)."""
    steps = BATCHES_PER_EPOCH * world
    data = torch.cat([batch(step) for step in range(steps)])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=BATCH)


def trainer(
    epochs: int,
    folder: Path,
    strategy: str = "auto",
    devices: int = 1,
    callbacks: Sequence[Any] = (),
    **overrides: Any,
) -> L.Trainer:
    """A quiet CPU Trainer with the plugin; ModelCheckpoint keeps every epoch's checkpoint
    in ``folder``, after ``callbacks``. No validation unless ``overrides`` say so."""
    options: dict[str, Any] = {"limit_val_batches": 0, **overrides}
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=TrainerFP8Precision(**plugin_options("net.")),
        callbacks=[*callbacks, ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def epoch_checkpoint(folder: Path, epochs: int) -> Path:
    """The file ModelCheckpoint wrote in the ``first`` phase at the end of epoch ``epochs``."""
    return folder / "first" / f"epoch={epochs - 1}-step={epochs * BATCHES_PER_EPOCH}.ckpt"


def trainer_run(phase: str, folder: Path, strategy: str = "auto", devices: int = 1) -> dict:
    """``full``: EPOCHS epochs. ``first``: FIRST_EPOCHS (ModelCheckpoint writes one file per
    epoch), then ``trainer.save_checkpoint``. ``resume-saved`` / ``resume-epoch``: a new
    module and Trainer, ``fit(ckpt_path=...)`` from that file / ModelCheckpoint's."""
    module = TinyModule()
    epochs = FIRST_EPOCHS if phase == "first" else EPOCHS
    run = trainer(epochs, folder / phase, strategy, devices)
    path = {
        "resume-saved": folder / "saved.ckpt",
        "resume-epoch": epoch_checkpoint(folder, FIRST_EPOCHS),
    }.get(phase)
    run.fit(module, loader(devices), ckpt_path=path)
    if phase == "first":
        run.save_checkpoint(folder / "saved.ckpt")
    return outcome(module.net, module.losses)


#: What each torchrun launch runs: the runs to compare, then the resumes in fresh processes.
LAUNCHES = {
    "train": [("fabric", "full"), ("fabric", "first"), ("trainer", "full"), ("trainer", "first")],
    "resume": [("fabric", "resume"), ("trainer", "resume-saved"), ("trainer", "resume-epoch")],
}


def main(launch: str, out: str) -> None:
    """One rank of DDP runs under torchrun: each run, then this rank's outcome of it."""
    import torch.distributed as dist

    from dist_workers.launch import shutdown

    folder = Path(out)
    for stack, phase in LAUNCHES[launch]:
        run = fabric_run if stack == "fabric" else trainer_run
        result = run(phase, folder, strategy="ddp", devices=2)
        torch.save(result, folder / f"{stack}-{phase}-rank{dist.get_rank()}.pt")
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
