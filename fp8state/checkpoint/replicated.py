"""The check that FP8 metadata is identical on every rank that saves it.

DCP stores a plain (non-DTensor) tensor that several ranks hold once, written by whichever
rank its planner picks; FP8 metadata is such a tensor. If ranks disagree, the other copies are
lost without a word. :func:`check_fp8_metadata_replicated` compares bit-exact digests across
ranks with one small collective; :func:`fp8state.checkpoint.dcp_save` calls it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fp8state._layout import from_packed
from fp8state.checkpoint._entries import fp8_modules, iter_extra_states
from fp8state.checkpoint._problems import keys_of, summarize
from fp8state.errors import DistributedStateError, FP8StateError
from fp8state.schema import is_payload

__all__ = ["check_fp8_metadata_replicated"]


def _digest(tensor: torch.Tensor) -> str:
    # Exact comparison, not a tolerance: DCP keeps one copy, so any bit that differs is lost.
    # clone(): a storage of exactly this tensor's bytes (a view's storage may hold more), read
    # through the buffer protocol, so numpy is not needed.
    host = tensor.detach().to("cpu").contiguous().clone()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{host.dtype}{tuple(host.shape)}".encode())
    h.update(bytes(host.untyped_storage()))
    return h.hexdigest()


def _local_digests(model_or_state_dict: nn.Module | Mapping[str, Any]) -> dict[str, dict]:
    """``{extra-state key: {payload key: digest}}`` of this rank's FP8 metadata."""
    payloads: dict[str, Any]
    if isinstance(model_or_state_dict, nn.Module):
        payloads = {
            f"{canonical}_extra_state": module.get_extra_state()
            for _, canonical, module in fp8_modules(model_or_state_dict)
        }
    else:
        payloads = {k: v for k, v in iter_extra_states(model_or_state_dict) if is_payload(v)}
    return {key: _field_digests(payload) for key, payload in payloads.items()}


def _field_digests(payload: Any) -> dict[str, str]:
    """A digest per payload field, so a difference is named by its field (``fwd.scale``)."""
    if isinstance(payload, torch.Tensor):
        payload = from_packed(payload.detach().to("cpu"))  # structure only: no value checks
    return {name: _digest(t) for name, t in payload.items() if isinstance(t, torch.Tensor)}


def _compare(gathered: list[dict[str, dict]], ranks: list[int]) -> list[FP8StateError]:
    """One problem per module whose metadata differs between the ranks that hold it."""
    problems: list[FP8StateError] = []
    keys = sorted({k for per_rank in gathered for k in per_rank})
    for key in keys:
        holders = [(r, g[key]) for r, g in zip(ranks, gathered, strict=True) if key in g]
        variants: dict[tuple, list[int]] = {}
        for rank, digests in holders:
            variants.setdefault(tuple(sorted(digests.items())), []).append(rank)
        if len(variants) == 1:
            continue
        fields = sorted(
            {name for _, d in holders for name in d if len({h[1].get(name) for h in holders}) > 1}
        )
        groups = " vs ".join(f"ranks {r}" for r in variants.values())
        problems.append(
            DistributedStateError(
                key,
                f"different {', '.join(fields)} on {groups}",
                "identical FP8 metadata on every rank that saves this module",
                "DCP keeps a single copy of replicated tensors, so the others would be lost.",
            )
        )
    return problems


def check_fp8_metadata_replicated(
    model_or_state_dict: nn.Module | Mapping[str, Any], group: Any = None
) -> int:
    """Raise if any module's FP8 metadata differs between the ranks of ``group``.

    Every rank hashes each FP8 extra state it holds (bit-exact, per payload key) and one
    ``all_gather_object`` collects the digests; every rank then reaches the same verdict, so
    either all raise or none does. Modules only some ranks hold (pipeline stages) are compared
    among those ranks. Call it with the process group that saves, which is where DCP
    de-duplicates; that is usually the whole world and spans several amax-reduction groups
    (see ``docs/checkpoints.md``).

    Args:
        model_or_state_dict: The model, or the state dict about to be saved (a nested one
            such as ``{"model": ..., "optim": ...}`` works too).
        group: The process group; None for the default group. Without an initialized
            process group there is nothing to compare and nothing happens.

    Returns:
        The number of FP8 extra states this rank checked.

    Raises:
        DistributedStateError: naming each module, the payload keys that differ and which
            ranks hold which variant.

    Example:
        Before a ``torch.distributed.checkpoint.save`` of your own (``dcp_save`` calls it
        for you). In one process there is nothing to compare:

        >>> import torch, fp8state
        >>> from fp8state.checkpoint import check_fp8_metadata_replicated
        >>> model = torch.nn.Sequential(fp8state.Linear(16, 16), fp8state.Linear(16, 16))
        >>> check_fp8_metadata_replicated({"model": model.state_dict()})
        2
    """
    local = _local_digests(model_or_state_dict)
    if not (dist.is_available() and dist.is_initialized()):
        return len(local)
    world = dist.get_world_size(group)
    if world == 1:
        return len(local)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    problems = _compare(gathered, ranks)
    if problems:
        raise DistributedStateError(
            keys_of(problems),
            summarize(problems),
            "the same FP8 metadata on every rank (DCP stores one copy of replicated tensors)",
            "DCP would keep one rank's copy (dcp_save writes nothing). Reduce amaxes over "
            "every rank that holds a module "
            "(fp8_autocast(fp8_group=...) spanning the data-parallel ranks), or make the "
            "ranks' metadata equal (e.g. broadcast it from rank 0) before saving.",
        )
    return len(local)
