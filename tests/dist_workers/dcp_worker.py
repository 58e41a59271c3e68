"""Per-rank worker of tests/checkpoint/test_checkpoint_distributed.py: DCP save/load across
world sizes.

One spawn per world size runs a *phase*; the phases run in this order, each reading what the
previous ones wrote into the shared folder ``work``:

- ``save1`` (1 rank): FSDP2 model saved with ``dcp_save``                    -> ``<kind>_fsdp_w1``
- ``w2`` (2 ranks): DDP and FSDP2 models saved                  -> ``<kind>_ddp_w2``, ``_fsdp_w2``;
  loads 1 -> 2 (FSDP2, DDP, FSDP2 built on ``meta`` + ``to_empty``, and the consolidated file
  of ``fsdp_w1`` into FSDP2 and DDP); the replicated-metadata check on differing ranks.
- ``w1load`` (1 rank): loads 2 -> 1 (plain and FSDP2 models).
- ``w3`` (3 ranks): loads 2 -> 3 (FSDP2 with uneven shards, DDP).

Every rank writes ``<phase>_rank<r>.pt``: ``{kind: {record name: record}}`` where a record
holds the loaded model's whole state (:func:`models.full_state`) and where its FP8 buffers
live, or the error a step raised. The test compares them with models rebuilt from the seeds.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fp8state.checkpoint as ckpt
from dist_workers import models
from dist_workers.launch import init_gloo, shutdown
from fp8state.errors import DistributedStateError

#: (seed, salt) of each saved checkpoint; the test rebuilds the expected state from them.
SAVED = {"fsdp_w1": (11, 1), "ddp_w2": (21, 2), "fsdp_w2": (22, 3)}
#: Seed of the model whose rank 1 differs in the replicated-metadata check.
BAD_SEED, BAD_SALT, BAD_MODULE = 23, 4, "mlp"


def _shard(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in models.fp8_modules(model).values():
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ddp(model: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model)


def _record(model: nn.Module) -> dict[str, Any]:
    return {"state": models.full_state(model), "buffers": models.buffer_placement(model)}


def _try(records: dict[str, Any], name: str, step: Callable[[], Any]) -> None:
    # A failing step is recorded, not raised: the other steps' collectives must still match
    # on every rank, and the test reports which step failed with its traceback.
    try:
        records[name] = step()
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
        records[name] = {
            "error": type(err).__name__,
            "message": str(err),
            "key": getattr(err, "key", None),
            "traceback": traceback.format_exc(),
        }


def _phase_save1(kind: str, work: str, rec: dict[str, Any]) -> None:
    seed, salt = SAVED["fsdp_w1"]
    model = _shard(models.trained(kind, seed, salt))
    _try(
        rec,
        "save fsdp_w1",
        lambda: {"saved": bool(ckpt.dcp_save(model, os.path.join(work, f"{kind}_fsdp_w1")))},
    )


def _load(
    kind: str, work: str, source: str, wrap: Callable[[nn.Module], nn.Module], seed: int
) -> dict[str, Any]:
    model = wrap(models.build(kind, seed=seed))
    ckpt.dcp_load(model, os.path.join(work, f"{kind}_{source}"))
    return _record(model)


def _load_meta_fsdp(kind: str, work: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = models.Net(kind)
    _shard(model)
    model.to_empty(device="cpu")
    ckpt.dcp_load(model, os.path.join(work, f"{kind}_fsdp_w1"))
    return _record(model)


def _load_consolidated(kind: str, work: str, wrap: Callable[[nn.Module], nn.Module]) -> dict:
    model = wrap(models.build(kind, seed=97))
    state = ckpt.load(os.path.join(work, f"{kind}_fsdp_w1.pt"))
    ckpt.load_state_dict(model, state)
    return _record(model)


def _bad_save(kind: str, work: str) -> dict[str, Any]:
    model = models.trained(kind, BAD_SEED, BAD_SALT)
    if dist.get_rank() == 1:  # one more step on one rank only: metadata now differs
        module = models.fp8_modules(model)[BAD_MODULE]
        module.fp8_record_amax("fwd", 0, torch.tensor(99.0))
        module.fp8_update_scales("fwd")
    _shard(model)
    good = _shard(models.trained(kind, BAD_SEED, BAD_SALT))
    checked = ckpt.check_fp8_metadata_replicated(good)
    folder = os.path.join(work, f"{kind}_bad_w2")
    try:
        ckpt.dcp_save(model, folder)
    except DistributedStateError as err:
        return {
            "checked": checked,
            "raised": type(err).__name__,
            "key": err.key,
            "found": err.found,
            "message": str(err),
            "written": os.path.exists(os.path.join(folder, ".metadata")),
        }
    return {
        "checked": checked,
        "raised": None,
        "written": os.path.exists(os.path.join(folder, ".metadata")),
    }


def _phase_w2(kind: str, work: str, rec: dict[str, Any]) -> None:
    seed, salt = SAVED["ddp_w2"]
    ddp = _ddp(models.build(kind, seed=seed))
    models.fill_fp8(ddp, salt)
    _try(
        rec,
        "save ddp_w2",
        lambda: {"saved": bool(ckpt.dcp_save(ddp, os.path.join(work, f"{kind}_ddp_w2")))},
    )
    seed, salt = SAVED["fsdp_w2"]
    fsdp = _shard(models.trained(kind, seed, salt))
    _try(
        rec,
        "save fsdp_w2",
        lambda: {"saved": bool(ckpt.dcp_save(fsdp, os.path.join(work, f"{kind}_fsdp_w2")))},
    )
    _try(rec, "fsdp_w1->fsdp2", lambda: _load(kind, work, "fsdp_w1", _shard, 99))
    _try(rec, "fsdp_w1->ddp2", lambda: _load(kind, work, "fsdp_w1", _ddp, 98))
    _try(rec, "fsdp_w1->meta_fsdp2", lambda: _load_meta_fsdp(kind, work))
    _try(rec, "consolidated_w1->fsdp2", lambda: _load_consolidated(kind, work, _shard))
    _try(rec, "consolidated_w1->ddp2", lambda: _load_consolidated(kind, work, _ddp))
    _try(rec, "replicated_check", lambda: _bad_save(kind, work))


def _phase_w1load(kind: str, work: str, rec: dict[str, Any]) -> None:
    _try(rec, "ddp_w2->plain1", lambda: _load(kind, work, "ddp_w2", lambda m: m, 96))
    _try(rec, "fsdp_w2->plain1", lambda: _load(kind, work, "fsdp_w2", lambda m: m, 95))
    _try(rec, "fsdp_w2->fsdp1", lambda: _load(kind, work, "fsdp_w2", _shard, 94))


def _phase_w3(kind: str, work: str, rec: dict[str, Any]) -> None:
    _try(rec, "fsdp_w2->fsdp3", lambda: _load(kind, work, "fsdp_w2", _shard, 93))
    _try(rec, "ddp_w2->ddp3", lambda: _load(kind, work, "ddp_w2", _ddp, 92))
    _try(rec, "ddp_w2->fsdp3", lambda: _load(kind, work, "ddp_w2", _shard, 91))


PHASES = {"save1": _phase_save1, "w2": _phase_w2, "w1load": _phase_w1load, "w3": _phase_w3}


def run(
    rank: int, world: int, store_file: str, phase: str, work: str, kinds: tuple[str, ...]
) -> None:
    """Entry point of one rank (``torch.multiprocessing`` passes ``rank`` first)."""
    init_gloo(rank, world, store_file)
    try:
        results: dict[str, dict[str, Any]] = {}
        for kind in kinds:
            results[kind] = {}
            PHASES[phase](kind, work, results[kind])
            dist.barrier()
        torch.save(results, os.path.join(work, f"{phase}_rank{rank}.pt"))
    finally:
        shutdown()
