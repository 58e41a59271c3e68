"""Build one TE ``_extra_state`` value per era from the spec (te_formats.md, sections 1-3).

:func:`extra_state` returns the value exactly as that era's ``get_extra_state`` put it into the
state dict, plus a :class:`Truth` that says what the conversion must produce. Storages TE kept
on the GPU are tagged ``cuda:0`` where the era pickles or archives them itself (E04-E07); for
E01-E03, whose tensors sit directly in the state dict, :func:`te_gen.models.save` tags
them when the file is written.
"""

from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from te_gen import recipes
from te_gen.history import FP8_MAX, TEMeta, active_slots, simulate
from te_gen.tepickle import as_uint8, saved_on, te_dumps

ERAS = ("E01", "E02", "E03", "E04", "E05", "E06", "E07", "E08", "E09", "E10")
OLD_LAYOUT = {"E01", "E02", "E03"}
AT_END = {"E07", "E08", "E09", "E10"}
STORES_INV = {"E05", "E06", "E07"}
STORES_RECIPE = {"E08", "E09", "E10"}
STORES_MAXIMA = set(ERAS) - {"E01"}
CUDA_INSIDE = {"E04", "E05", "E06", "E07"}


@dataclass
class Truth:
    """What the converter must produce for one module, independent of how it does it."""

    era: str
    num_gemms: int
    rows: int
    fwd: TEMeta
    bwd: TEMeta
    fp8_format: str
    margin: int
    algo: str
    defaulted: tuple[str, ...]
    at_end: bool
    old_layout: bool


@dataclass
class Spec:
    """FP8 settings of one generated module."""

    num_gemms: int = 1
    fp8: bool = True
    rows: int = 16
    steps: int = 5
    fmt: str = "HYBRID"
    margin: int = 0
    algo: str = "max"
    quantizes: bool = True  # False for attention without fp8_dpa: histories stay zero
    stateless: str | None = None  # a stateless recipe class name (E08-E10)
    recompute_deques: bool = False  # E02 only
    v16_autocast_key: bool = False  # E07 as written by v1.6-v1.7
    local_recipes: bool = False  # E09/E10 attention
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _efv(era: str, spec: Spec, step: int, pos: int) -> dict[str, Any]:
    fmax = FP8_MAX.get(spec.fmt, (57344, 57344))
    efv: dict[str, Any] = {}
    if era in STORES_RECIPE or era == "E07":
        efv["fp8_checkpoint"] = True
    efv.update(num_gemms=spec.num_gemms, fp8_max_fwd=fmax[0], fp8_max_bwd=fmax[1])
    if era in ("E02", "E03", "E04", "E05"):
        efv.update(
            first_module=pos == 0,
            autocast_id_fwd=step,
            global_fp8_buffer_pos_fwd=pos,
            update_amax_and_scale_fwd=True,
            autocast_id_bwd=step,
            global_fp8_buffer_pos_bwd=pos,
        )
    if era in ("E05", "E06"):
        efv.update(async_amax_reduction=False, fp8_checkpoint=True)
    if era == "E06":
        efv.update(autocast_id_fwd_stack=[], update_amax_and_scale_fwd=True)
    if era == "E07" and spec.v16_autocast_key:
        efv["buffer_index_and_autocast_key"] = [pos, "forward_False_key", pos, "backward_False_key"]
    if spec.local_recipes:
        efv["local_recipes"] = [_recipe(era, spec)]
    efv.update(spec.extra)
    return efv


def _recipe(era: str, spec: Spec) -> Any:
    if spec.stateless:
        return recipes.stateless(spec.stateless)
    return recipes.delayed_scaling(
        era, fmt=spec.fmt, margin=spec.margin, length=spec.rows, algo=spec.algo
    )


def _meta(era: str, spec: Spec) -> tuple[TEMeta, TEMeta]:
    gen = torch.Generator().manual_seed(spec.seed)
    old = era in OLD_LAYOUT
    metas = []
    for i, d in enumerate(("fwd", "bwd")):
        active = active_slots(spec.num_gemms, old, d, spec.quantizes)
        metas.append(
            simulate(
                len(active),
                active,
                rows=spec.rows,
                steps=spec.steps,
                at_end=era in AT_END,
                fp8_max=FP8_MAX.get(spec.fmt, (57344, 57344))[i],
                margin=spec.margin,
                gen=gen,
                pow2=era < "E06",
            )
        )
    return metas[0], metas[1]


def truth(era: str, spec: Spec, fwd: TEMeta, bwd: TEMeta) -> Truth:
    """The expected conversion: the recipe by docs/migration.md's conversion rules (stored
    recipe, else stored fp8 maxima, else defaults), the rest from the simulation."""
    if era in STORES_RECIPE:
        fmt, margin, algo, defaulted = spec.fmt, spec.margin, spec.algo, ()
    else:
        fmt = spec.fmt if era in STORES_MAXIMA else "HYBRID"
        margin, algo = 0, "max"
        defaulted = (("fp8_format",) if era == "E01" else ()) + ("margin", "amax_compute_algo")
    return Truth(
        era,
        spec.num_gemms,
        spec.rows,
        fwd,
        bwd,
        fmt,
        margin,
        algo,
        defaulted,
        era in AT_END,
        era in OLD_LAYOUT,
    )


def _bytesio(obj: Any, cuda: list[torch.Tensor]) -> io.BytesIO:
    buf = io.BytesIO()
    with saved_on("cuda:0", cuda):
        torch.save(obj, buf)  # TE never rewinds: the position stays at the end (PR #363)
    return buf


def _fp8_off(era: str) -> Any:
    if era in ("E01", "E02", "E03"):
        return None
    if era in ("E04", "E05", "E08"):
        return as_uint8(pickle.dumps(None))
    if era in ("E06", "E07"):
        return _bytesio(None, [])
    return torch.empty(0, dtype=torch.uint8)


def global_buffer(step: int, metas: list[tuple[TEMeta, TEMeta]]) -> dict[str, list[torch.Tensor]]:
    """The v0.x global amax buffer: every module's newest amaxes, forward and reverse order."""
    return {
        f"FWD_AMAX_{step}": [f.amax_history[0].clone() for f, _ in metas],
        f"BWD_AMAX_{step}": [b.amax_history[0].clone() for _, b in metas[::-1]],
    }


def extra_state(
    era: str, spec: Spec, *, pos: int = 0, gbuf: dict[str, Any] | None = None
) -> tuple[Any, Truth | None]:
    """The ``_extra_state`` value TE ``era`` wrote for a module, and what it must become."""
    if not spec.fp8 or (spec.stateless and era == "E10"):
        return _fp8_off(era), None
    step = spec.steps
    efv = _efv(era, spec, step, pos)
    if spec.stateless:
        if era not in ("E08", "E09"):
            raise ValueError("stateless recipes are pickled by E08/E09 only")
        return as_uint8(te_dumps({"recipe": _recipe(era, spec), "extra_fp8_variables": efv})), None
    fwd, bwd = _meta(era, spec)
    gbuf = gbuf if gbuf is not None else global_buffer(step, [(fwd, bwd)])
    inv = era in STORES_INV
    state: dict[str, Any] = {}
    if era in STORES_RECIPE:
        state["recipe"] = _recipe(era, spec)
    state["scale_fwd"] = fwd.scale
    if inv:
        state["scale_inv_fwd"] = fwd.scale_inv
    state["amax_history_fwd"] = fwd.amax_history
    state["scale_bwd"] = bwd.scale
    if inv:
        state["scale_inv_bwd"] = bwd.scale_inv
    state["amax_history_bwd"] = bwd.amax_history
    if era in ("E02", "E03", "E04", "E05", "E06"):
        state["global_fp8_buffer"] = gbuf if era != "E06" else {}
    if era == "E02":
        state["global_fp8_recompute_buffer"] = (
            [collections.deque([[fwd.scale.clone(), bwd.scale.clone()]])]
            if spec.recompute_deques
            else []
        )
    if era == "E06":
        state["global_fp8_state"] = {
            "FP8_AUTOCAST_COUNTER": step,
            "FP8_CURRENT_CONTEXT_ID": 0,
            "FP8_AUTOCAST_DEPTH": 0,
            "buffer_delete_key_fwd": None,
            "buffer_delete_key_bwd": None,
            "dp_amax_reduce_interval": None,
            "dp_amax_reduce_forward_idx": 0,
            "dp_amax_reduce_backward_idx": 0,
        }
    state["extra_fp8_variables"] = efv
    tensors = [
        fwd.scale,
        fwd.scale_inv,
        fwd.amax_history,
        bwd.scale,
        bwd.scale_inv,
        bwd.amax_history,
    ]
    expected = truth(era, spec, fwd, bwd)
    if era == "E01":
        return [
            fwd.scale,
            fwd.amax_history,
            bwd.scale,
            bwd.amax_history,
            gbuf,
            True,
            pos,
            pos,
            step,
            step,
        ], expected
    if era in ("E02", "E03"):
        return state, expected
    if era in ("E04", "E05"):
        buffers = [t for ts in gbuf.values() for t in ts]
        with saved_on("cuda:0", tensors + buffers):
            return as_uint8(te_dumps(state)), expected
    if era in ("E06", "E07"):
        return _bytesio(state, tensors), expected
    # E08-E10: CPU copies, pickled with the recipe object (PR #1335).
    return as_uint8(te_dumps(state)), expected
