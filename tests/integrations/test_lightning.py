"""fp8state's Lightning precision plugins: conversion at setup, FP8 steps, exact resumes.

A resumed run (k steps, save, new objects, load, the rest) must equal the uninterrupted run bit
for bit: losses, parameters and every FP8 module's metadata. The runs are in
dist_workers/lightning_worker.py; the DDP ones run it under torchrun, two gloo ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers.compiling import aot_eager_keeping
from _helpers.paths import REPO_ROOT, TESTS
from _helpers.state import assert_same
from dist_workers import lightning_worker as runs
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch._dynamo.utils import counters

import fp8state
from fp8state.errors import CheckpointError, ConfigError
from fp8state.integrations.lightning import (
    CHECKPOINT_KEY,
    FabricFP8Precision,
    TrainerFP8Precision,
    restore_fp8_checkpoint,
)

WORKER = TESTS / "dist_workers" / "lightning_worker.py"


def assert_resumed_run_is_the_full_run(full: dict, first: dict, resumed: dict) -> None:
    assert torch.equal(full["losses"], torch.cat([first["losses"], resumed["losses"]]))
    assert_same(full["params"], resumed["params"], where="params")
    assert_same(full["meta"], resumed["meta"], where="FP8 metadata")
    assert not torch.equal(full["losses"][:1], full["losses"][-1:])  # it did train


def fp8_modules(model: nn.Module) -> dict[str, fp8state.FP8StateMixin]:
    return {n: m for n, m in model.named_modules() if isinstance(m, fp8state.FP8StateMixin)}


# -------------------------------------------------------------------------------- Fabric
def test_fabric_setup_converts_in_place_and_every_forward_runs_in_fp8() -> None:
    net = runs.plain_net()
    params = list(net.parameters())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # built before setup: still valid
    recipe = fp8state.DelayedScaling(amax_history_len=8, margin=1)
    plugin = FabricFP8Precision(recipe=recipe, **runs.plugin_options())
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugin)
    model, optimizer = fabric.setup(net, optimizer)
    assert [type(m) for m in net] == [
        nn.Identity,
        fp8state.LayerNormLinear,  # fused from the LayerNorm and the Linear
        nn.GELU,
        fp8state.LayerNormMLP,
        fp8state.Linear,
    ]
    assert all(a is b for a, b in zip(net.parameters(), params, strict=True))
    before = net[4].weight.detach().clone()
    loss = model(runs.batch(0)).square().mean()
    fabric.backward(loss)
    optimizer.step()
    assert not torch.equal(net[4].weight, before)
    for name, module in fp8_modules(net).items():
        assert module.fp8_min_gemm_macs == 0, name
        assert module.fp8_last_gemm_backend == "emulated", name  # FP8, not high precision
        assert module.fp8_recipe == recipe, name
        assert bool(module.fp8_meta("fwd").amax_history[0, 0] > 0), name
        assert bool(module.fp8_meta("bwd").amax_history[0, 0] > 0), name  # backward too
    # Outside the set-up model's forward, nothing runs in FP8: the plugin's context is scoped.
    assert not fp8state.is_fp8_enabled()
    with fabric.autocast():
        assert fp8state.is_fp8_enabled()


def test_fabric_resume_is_bit_for_bit(tmp_path: Path) -> None:
    full = runs.fabric_run("full", tmp_path)
    first = runs.fabric_run("first", tmp_path)
    resumed = runs.fabric_run("resume", tmp_path)  # a new Fabric, model and optimizer
    assert len(first["losses"]) == runs.FIRST_STEPS
    assert_resumed_run_is_the_full_run(full, first, resumed)


def test_fabric_trains_a_compiled_model_as_eager() -> None:
    # fabric.setup(torch.compile(net)) converts the module under the compiled wrapper and
    # compiles it again; its steps (aot_eager: eager's kernels) equal the eager model's.
    results, graphs = [], []
    keep = aot_eager_keeping(graphs)
    for compiled in (False, True):
        torch._dynamo.reset()
        net = runs.plain_net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        plugin = FabricFP8Precision(**runs.plugin_options())
        fabric = Fabric(accelerator="cpu", devices=1, plugins=plugin)
        model, optimizer = fabric.setup(
            torch.compile(net, backend=keep) if compiled else net, optimizer
        )
        losses = []
        for step in range(3):
            loss = model(runs.batch(step)).square().mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        assert set(fp8_modules(net)) == {"1", "3", "4"}
        results.append((torch.stack(losses), net.state_dict()))
    assert len(graphs) == 1  # the converted model, compiled once
    assert torch.equal(results[0][0], results[1][0])
    assert_same(results[0][1], results[1][1])


def test_convert_false_takes_the_model_as_it_is() -> None:
    net = nn.Sequential(nn.Linear(32, 32), fp8state.Linear(32, 32))
    plugin = FabricFP8Precision(convert=False, fp8_min_gemm_macs=0)
    model = Fabric(accelerator="cpu", devices=1, plugins=plugin).setup_module(net)
    model(torch.randn(4, 32))
    assert type(net[0]) is nn.Linear
    assert net[1].fp8_last_gemm_backend == "emulated"


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"recipe": {"margin": 1}}, "fp8_autocast(fp8_recipe=...)"),
        ({"gemm_backend": "cublas"}, "fp8_autocast(gemm_backend=...)"),
        ({"fp8_min_gemm_macs": -1}, "FabricFP8Precision(fp8_min_gemm_macs=...)"),
        ({"fp8_min_gemm_macs": True}, "FabricFP8Precision(fp8_min_gemm_macs=...)"),
    ],
)
def test_wrong_arguments_are_config_errors(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        FabricFP8Precision(**kwargs)
    assert info.value.key == key


# ------------------------------------------------------------------------------- Trainer
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """The uninterrupted run, and the first part of the interrupted one (its checkpoints)."""
    folder = tmp_path_factory.mktemp("trainer")
    return folder, runs.trainer_run("full", folder), runs.trainer_run("first", folder)


@pytest.mark.parametrize("checkpoint", ["saved", "epoch"])
def test_trainer_resume_with_ckpt_path_is_bit_for_bit(
    trainer_runs: tuple[Path, dict, dict], checkpoint: str
) -> None:
    folder, full, first = trainer_runs
    resumed = runs.trainer_run(f"resume-{checkpoint}", folder)  # a new module and Trainer
    assert len(first["losses"]) == runs.FIRST_EPOCHS * runs.BATCHES_PER_EPOCH
    assert_resumed_run_is_the_full_run(full, first, resumed)


def test_trainer_checkpoint_fits_the_module_as_built(trainer_runs: tuple[Path, dict, dict]) -> None:
    folder, _, first = trainer_runs
    checkpoint = torch.load(folder / "saved.ckpt", weights_only=True)
    plain = runs.TinyModule()
    assert sorted(checkpoint["state_dict"]) == sorted(plain.state_dict())
    assert "net.3._extra_state" in checkpoint["state_dict"]  # built as an fp8state module
    assert CHECKPOINT_KEY in checkpoint
    # Lightning's own loader gives the unconverted module with the trained weights.
    loaded = runs.TinyModule.load_from_checkpoint(folder / "saved.ckpt", weights_only=True)
    assert type(loaded.net[1]) is nn.Linear
    assert_same(first["params"]["1.weight"], loaded.net[1].weight.detach(), where="trained weight")
    assert_same(first["meta"]["3"]["fwd"], list(loaded.net[3].fp8_meta("fwd")))


def test_trainer_restores_a_module_it_converted_already(
    trainer_runs: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    folder, full, first = trainer_runs
    module = runs.TinyModule()
    runs.trainer(runs.FIRST_EPOCHS, tmp_path).fit(module, runs.loader())  # converts it
    with torch.no_grad():  # move away from the checkpoint, weights and metadata both
        for param in module.parameters():
            param.add_(1.0)
        for fp8_module in fp8_modules(module).values():
            fp8_module.fp8_meta("fwd").scale.fill_(3.0)
    module.losses = []
    run = runs.trainer(runs.EPOCHS, tmp_path)
    run.fit(module, runs.loader(), ckpt_path=folder / "saved.ckpt")
    assert_resumed_run_is_the_full_run(full, first, runs.outcome(module.net, module.losses))


class _Quiet(runs.TinyModule):
    """Its losses are taken by a callback: ``loss.item()`` in the step is a graph break."""

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach())


def test_trainer_fits_a_compiled_module_as_eager(tmp_path: Path) -> None:
    # trainer.fit(torch.compile(module)): Lightning unwraps the module, the plugin converts it,
    # and Lightning compiles the training step; with aot_eager its steps equal the eager
    # fit's, in one graph.
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        module, losses = _Quiet(), _Losses()
        run = runs.trainer(2, tmp_path / str(compiled), callbacks=[losses])
        run.fit(torch.compile(module, backend="aot_eager") if compiled else module, runs.loader())
        assert type(module.net[4]) is fp8state.Linear
        results.append((torch.stack(losses.losses), module.state_dict()))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert len(results[1][0]) == 2 * runs.BATCHES_PER_EPOCH
    assert torch.equal(results[0][0], results[1][0])
    assert_same(results[0][1], results[1][1])


def test_validation_steps_run_in_fp8(tmp_path: Path) -> None:
    module = runs.TinyModule()
    run = runs.trainer(1, tmp_path, limit_val_batches=1)
    run.validate(module, runs.loader(), verbose=False)
    assert type(module.net[4]) is fp8state.Linear
    assert module.net[4].fp8_last_gemm_backend == "emulated"
    assert bool(module.net[4].fp8_meta("fwd").amax_history[0, 0] > 0)


def test_a_wrong_fp8state_entry_is_a_checkpoint_error() -> None:
    model = fp8state.convert_model(nn.Sequential(nn.Linear(16, 16)))
    checkpoint = {"state_dict": {}, CHECKPOINT_KEY: {"fp8_metadata": [1, 2]}}
    with pytest.raises(CheckpointError) as info:
        restore_fp8_checkpoint(model, checkpoint)
    assert info.value.key == f'checkpoint["{CHECKPOINT_KEY}"]'
    assert "TrainerFP8Precision" in info.value.expected
    assert restore_fp8_checkpoint(model, {"state_dict": {}}) is False  # no entry: nothing to do


def test_trainer_plugin_is_lightnings_precision_plugin() -> None:
    from lightning.pytorch.plugins.precision import Precision

    plugin = TrainerFP8Precision(fp8_min_gemm_macs=0)
    assert isinstance(plugin, Precision) and isinstance(plugin, FabricFP8Precision)
    assert plugin.precision == "32-true"  # the weights keep their dtype


def test_without_lightning_the_import_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None  # as if it were not installed\n"
        "import fp8state\n"
        "try:\n"
        "    import fp8state.integrations.lightning\n"
        "except fp8state.errors.ConfigError as err:\n"
        "    print(err.fix)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "pip install fp8state[lightning]" in run.stdout


# ---------------------------------------------------------------------- DDP, two gloo ranks
def torchrun(launch: str, out: Path, timeout: float = 300) -> None:
    """Run the worker's ``launch`` on two ranks in fresh processes; kill all at the deadline."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO_ROOT)])}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(WORKER), launch, str(out)]
    proc = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the deadline ends every rank
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"torchrun {launch} ran past {timeout:.0f} s") from None
    assert proc.returncode == 0, output[-6000:]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], list[dict]]:
    """Both launches, once: ``result(stack, phase)`` is the two ranks' outcomes of a run."""
    folder = tmp_path_factory.mktemp("ddp")
    torchrun("train", folder)
    torchrun("resume", folder)  # new processes: nothing survives but the checkpoint files

    def result(stack: str, phase: str) -> list[dict]:
        return [
            torch.load(folder / f"{stack}-{phase}-rank{r}.pt", weights_only=True) for r in (0, 1)
        ]

    return result


def assert_ranks_agree(results: list[dict]) -> None:
    assert_same(results[0]["params"], results[1]["params"], where="DDP params")
    assert_same(results[0]["meta"], results[1]["meta"], where="reduced FP8 metadata")
    assert not torch.equal(results[0]["losses"], results[1]["losses"])  # each its own data


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stack", "resume"),
    [("fabric", "resume"), ("trainer", "resume-saved"), ("trainer", "resume-epoch")],
)
def test_ddp_resume_is_bit_for_bit(
    ddp_runs: Callable[[str, str], list[dict]], stack: str, resume: str
) -> None:
    full, first, resumed = (ddp_runs(stack, phase) for phase in ("full", "first", resume))
    assert_ranks_agree(full)
    for rank in (0, 1):
        assert_resumed_run_is_the_full_run(full[rank], first[rank], resumed[rank])
