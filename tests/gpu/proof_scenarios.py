"""The processes of the two-GPU device proof; each runs fresh and writes one JSON result.

Run by ``two_gpu_device_proof.py`` as ``python proof_scenarios.py NAME CONFIG.json OUT.json``.
The roles ``dev0``/``dev1`` are ``cuda:0``/``cuda:1`` on a GPU machine and ``cpu`` in the CPU
dry run (which CI uses to exercise this logic; GPU figures then read "unavailable").

Every step that may fail is recorded as an error with its traceback and the next step still
runs, so one run yields every figure it can.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _p in (_HERE.parents[1], _HERE.parent, _HERE):  # repo root (fp8state), tests/, tests/gpu/
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import device_probe  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _helpers.state import assert_same  # noqa: E402
from dist_workers import models  # noqa: E402
from dist_workers.launch import shutdown  # noqa: E402
from torch import nn  # noqa: E402

import fp8state.checkpoint as ckpt  # noqa: E402
from fp8state.errors import DistributedStateError  # noqa: E402


class Context:
    """Configuration of one child and the results it collects."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = config
        self.cuda = config["cuda"]
        self.work = Path(config["work"])
        self.kind = config["kind"]
        self.uuids = {int(k): v for k, v in config.get("uuids", {}).items()}
        self.dev0 = torch.device("cuda:0" if self.cuda else "cpu")
        self.dev1 = torch.device("cuda:1" if self.cuda else "cpu")
        self.out: dict[str, Any] = {"pid": os.getpid(), "steps": {}, "figures": {}}

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; record its result or its error under ``name``."""
        try:
            result = fn()
            self.out["steps"][name] = {"ok": True, "result": result}
            return result
        except Exception as err:  # noqa: BLE001 - recorded; the parent turns it into a check
            self.out["steps"][name] = {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
            }
            return None

    def measure(self, label: str, index: int = 0) -> None:
        """Record what this process holds on ``cuda:index`` (after syncing its own work)."""
        if self.cuda:
            torch.cuda.synchronize(torch.cuda.current_device())
        self.out["figures"][label] = device_probe.snapshot(
            index, os.getpid(), self.uuids, cuda=self.cuda
        )


def _same(model: nn.Module, expected_file: Path) -> dict[str, Any]:
    """Compare a loaded model with the saved state; say where its FP8 buffers live."""
    expected = torch.load(expected_file, weights_only=True)
    assert_same(models.full_state(model), expected)
    return {"equal": True, "fp8_buffers": sorted(set(models.buffer_placement(model).values()))}


def _devices(state: dict[str, Any]) -> dict[str, Any]:
    """Devices of a loaded state dict: user weights vs fp8state metadata."""
    weights, meta = set(), set()
    for key, value in state.items():
        if key.endswith("_extra_state"):
            meta.add(str(value.device))
        else:
            weights.add(str(value.device))
    return {"weights": sorted(weights), "fp8_metadata": sorted(meta)}


def save_dev0(ctx: Context) -> None:
    """Save from ``dev0``: a torch.save file, a DCP folder, and the expected values."""
    if ctx.cuda:
        torch.cuda.set_device(0)
    model = models.build(ctx.kind, seed=None, device=ctx.dev0)
    models.fill_fp8(model, salt=1)
    torch.save(model.state_dict(), ctx.work / "plain.pt")
    ctx.step("dcp_save", lambda: bool(ckpt.dcp_save(model, ctx.work / "dcp")))
    torch.save(models.full_state(model), ctx.work / "expected.pt")
    ctx.out["saved_devices"] = _devices(model.state_dict())


def load_dev1(ctx: Context) -> None:
    """Fresh process, ``dev1`` only: every fp8state load path, then plain torch.load."""
    if ctx.cuda:
        torch.cuda.set_device(1)  # the first CUDA call of this process
    expected = ctx.work / "expected.pt"
    ctx.measure("start")
    model = models.build(ctx.kind, seed=None, device=ctx.dev1)
    ctx.measure("baseline")
    ctx.measure("baseline_own_gpu", 1)

    def fp8state_load() -> dict:
        ckpt.load_state_dict(model, ckpt.load(ctx.work / "plain.pt"))
        return _same(model, expected)

    ctx.step("fp8state_load", fp8state_load)
    ctx.measure("after_fp8state_load")
    ctx.measure("after_fp8state_load_own_gpu", 1)

    def dcp_load() -> dict:
        fresh = models.build(ctx.kind, seed=None, device=ctx.dev1)
        ckpt.dcp_load(fresh, ctx.work / "dcp")
        return _same(fresh, expected)

    ctx.step("dcp_load", dcp_load)
    ctx.measure("after_dcp_load")

    def torch_load_mapped() -> dict:
        fresh = models.build(ctx.kind, seed=None, device=ctx.dev1)
        fresh.load_state_dict(
            torch.load(ctx.work / "plain.pt", weights_only=True, map_location=ctx.dev1)
        )
        return _same(fresh, expected)

    ctx.step("torch_load_map_location_dev1", torch_load_mapped)
    ctx.measure("after_torch_load_map_location_dev1")

    # Control, last (it may put a context on dev0): PyTorch restores the user's weights where
    # they were saved; fp8state's metadata is CPU tensors and stays there.
    def plain_torch_load() -> dict:
        state = torch.load(ctx.work / "plain.pt", weights_only=True)
        devices = _devices(state)
        fresh = models.build(ctx.kind, seed=None, device=ctx.dev1)
        fresh.load_state_dict(state)
        return {"devices": devices, **_same(fresh, expected)}

    ctx.step("plain_torch_load", plain_torch_load)
    ctx.measure("after_plain_torch_load")


class _Split(nn.Module):
    """A model split over two devices in one process (pipeline stages, dispatch_model)."""

    def __init__(self, kind: str, dev_a: torch.device, dev_b: torch.device) -> None:
        super().__init__()
        self.a = models.Net(kind, device=dev_a)
        self.b = models.Net(kind, device=dev_b)


def split_current_dev0(ctx: Context) -> None:
    """Current device ``dev0``, half the model on ``dev1``: loading adds nothing to dev0."""
    if ctx.cuda:
        torch.cuda.set_device(0)
    model = _Split(ctx.kind, ctx.dev0, ctx.dev1)
    models.fill_fp8(model, salt=2)
    torch.save(model.state_dict(), ctx.work / "split.pt")
    torch.save(models.full_state(model), ctx.work / "split_expected.pt")
    fresh = _Split(ctx.kind, ctx.dev0, ctx.dev1)
    del model
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(0)
    ctx.measure("before_load")

    def load() -> dict:
        ckpt.load_state_dict(fresh, ckpt.load(ctx.work / "split.pt"))
        return {
            name: sorted(set(models.buffer_placement(getattr(fresh, name)).values()))
            for name in ("a", "b")
        }

    ctx.step("fp8state_load", load)
    ctx.measure("after_load")
    # Compared only now: reading the state back (get_extra_state) may use a temporary on
    # each stage's own device, which is saving's cost, not loading's.
    ctx.step("verify", lambda: _same(fresh, ctx.work / "split_expected.pt"))


def nccl_rank(ctx: Context) -> None:
    """One rank of a 2-rank run (NCCL on GPUs, gloo in the dry run)."""
    rank = int(os.environ["RANK"])
    dev = ctx.dev0 if rank == 0 else ctx.dev1
    ctx.out["rank"] = rank
    if ctx.cuda:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")
    try:
        _nccl_steps(ctx, rank, dev)
    finally:
        shutdown()


def _nccl_steps(ctx: Context, rank: int, dev: torch.device) -> None:
    plain, expected = ctx.work / "nccl_plain.pt", ctx.work / "nccl_expected.pt"
    if rank == 0:
        model = models.build(ctx.kind, seed=None, device=dev)
        models.fill_fp8(model, salt=5)
        torch.save(model.state_dict(), plain)
        torch.save(models.full_state(model), expected)
    dist.barrier()  # also brings the communicator up: the baseline includes it
    if rank == 1:
        ctx.measure("baseline")  # after the communicator is up: NCCL's share is in it
        ctx.measure("baseline_own_gpu", 1)
        model = models.build(ctx.kind, seed=None, device=dev)

        def fp8state_load() -> dict:
            ckpt.load_state_dict(model, ckpt.load(plain))
            return _same(model, expected)

        ctx.step("fp8state_load", fp8state_load)
        ctx.measure("after_fp8state_load")
    dist.barrier()
    ctx.step("fsdp2_dcp_round_trip", lambda: _fsdp2_round_trip(ctx, dev))
    ctx.step("replicated_check", lambda: _differing_ranks(ctx, rank, dev))
    if rank == 1:
        ctx.measure("after_fsdp2")
    dist.barrier()
    if rank == 1:  # control, last: the user's weights go back to cuda:0, metadata does not
        ctx.step("plain_torch_load", lambda: _devices(torch.load(plain, weights_only=True)))
        ctx.measure("after_plain_torch_load")
    dist.barrier()


def _shard(model: nn.Module, device_type: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for module in models.fp8_modules(model).values():
        fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp2_round_trip(ctx: Context, dev: torch.device) -> dict:
    model = models.build(ctx.kind, seed=None, device=dev)
    models.fill_fp8(model, salt=6)
    _shard(model, dev.type)
    ckpt.dcp_save(model, ctx.work / "nccl_dcp")
    fresh = _shard(models.build(ctx.kind, seed=None, device=dev), dev.type)
    ckpt.dcp_load(fresh, ctx.work / "nccl_dcp")
    assert_same(models.full_state(fresh), models.full_state(model))
    return {"equal": True, "fp8_buffers": sorted(set(models.buffer_placement(fresh).values()))}


def _differing_ranks(ctx: Context, rank: int, dev: torch.device) -> dict:
    model = models.build(ctx.kind, seed=None, device=dev)
    models.fill_fp8(model, salt=7 + rank)  # every module differs between the ranks
    try:
        ckpt.dcp_save(model, ctx.work / "nccl_bad")
    except DistributedStateError as err:
        return {
            "raised": True,
            "key": err.key,
            "written": (ctx.work / "nccl_bad" / ".metadata").exists(),
        }
    return {"raised": False}


SCENARIOS: dict[str, Callable[[Context], None]] = {
    "save_dev0": save_dev0,
    "load_dev1": load_dev1,
    "split_current_dev0": split_current_dev0,
    "nccl_rank": nccl_rank,
}


def main(argv: list[str]) -> int:
    """``NAME CONFIG.json OUT.json``: run one scenario, always write OUT.json."""
    name, config_path, out_path = argv
    ctx = Context(json.loads(Path(config_path).read_text()))
    try:
        SCENARIOS[name](ctx)
    except Exception:  # noqa: BLE001 - the whole scenario's failure is a result too
        ctx.out["fatal"] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(ctx.out, indent=1, default=str))
    return 0 if "fatal" not in ctx.out else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
