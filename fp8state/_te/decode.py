"""Per-era decoders: the object inside a TE extra state -> TE's tensors, still in TE's layout.

Which era wrote a value follows from its container and keys (te_formats.md, section 2):

==========================  ==========  ================================================
container                   era         tell-tale
==========================  ==========  ================================================
list of 10                  E01         ``[scale_fwd, amax_history_fwd, scale_bwd, ...]``
dict (in the state dict)    E02         ``global_fp8_recompute_buffer``
dict (in the state dict)    E03         neither ``scale_inv_*`` nor a recipe
uint8 pickle                E04         no ``scale_inv_*``
uint8 pickle                E05         ``scale_inv_*`` and ``global_fp8_buffer``
BytesIO archive             E06         ``global_fp8_buffer`` / ``global_fp8_state``
BytesIO archive             E07         ``scale_inv_*``, no global keys
uint8 pickle                E08-E10     a pickled ``recipe`` object
==========================  ==========  ================================================

A dict that was already unpickled (passed straight to ``set_extra_state``) is classified by its
keys the same way. Values are validated here: shapes, dtypes, finite positive scales and finite
non-negative amaxes. Nothing is converted yet (:mod:`fp8state._te.to_schema` does that).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8state._payload_checks import dense_problem
from fp8state._te import containers, standins
from fp8state._te.eras import Era, era
from fp8state._te.sniff import era_of_dict
from fp8state.errors import LegacyFormatError
from fp8state.slots import DIRECTIONS

__all__ = ["TEState", "NoFP8State", "decode_opened"]

_TENSOR_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
# Keys of ops-based modules (te.ops, te.LayerNorm/RMSNorm from v1.13; te_formats.md, 7).
_OPS_KEYS = frozenset({"forward", "backward", "input", "param", "grad_output"})


@dataclass(frozen=True)
class TEState:
    """TE's FP8 tensors of one module, validated, on the CPU, in TE's own layout and order.

    Attributes:
        era: The format that wrote them.
        scale, scale_inv, amax_history: Per direction (``"fwd"``, ``"bwd"``); ``scale_inv`` is
            None where the era does not store it.
        num_gemms: GEMM count implied by the shapes.
        te_num_gemms: ``extra_fp8_variables["num_gemms"]`` where TE stored it.
        fp8_max: ``(fp8_max_fwd, fp8_max_bwd)`` where TE stored them (E02-E07).
        recipe: The pickled recipe (E08-E10), else None.
        dropped: What the value held that fp8state does not keep (global buffers, counters).
    """

    era: Era
    scale: dict[str, torch.Tensor]
    scale_inv: dict[str, torch.Tensor | None]
    amax_history: dict[str, torch.Tensor]
    num_gemms: int
    te_num_gemms: int | None = None
    fp8_max: tuple[Any, Any] | None = None
    recipe: standins.TEObject | None = None
    dropped: tuple[str, ...] = ()

    @property
    def rows(self) -> int:
        """TE's history length L."""
        return int(self.amax_history["fwd"].shape[0])


@dataclass(frozen=True)
class NoFP8State:
    """A value that holds no FP8 state, and why."""

    era: str
    reason: str
    te_num_gemms: int | None = None
    recipe: standins.TEObject | None = field(default=None, compare=False)


def _err(key: str, found: str, expected: str, fix: str = "The checkpoint is corrupt.") -> Exception:
    return LegacyFormatError(f"[{key!r}]" if key else "", found, expected, fix)


def _tensor(obj: Any, key: str, dim: int) -> torch.Tensor:
    if not isinstance(obj, torch.Tensor):
        raise _err(key, f"a {type(obj).__name__}", f"a {dim}-D float32 tensor")
    problem = dense_problem(obj)
    if problem is not None:
        raise _err(key, problem, "a dense tensor with data")
    if obj.dtype != torch.float32 or obj.dim() != dim:
        raise _err(
            key, f"dtype {obj.dtype} with shape {tuple(obj.shape)}", f"a {dim}-D float32 tensor"
        )
    return obj.detach().to("cpu")


def _int_or_none(efv: Mapping[str, Any], name: str) -> int | None:
    value = efv.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _first_bad(t: torch.Tensor, ok: torch.Tensor) -> float:
    return float(t[~ok][0].item())


def _check_values(
    scale: dict[str, torch.Tensor],
    scale_inv: dict[str, torch.Tensor | None],
    history: dict[str, torch.Tensor],
) -> None:
    for d in DIRECTIONS:
        for name, t in (("scale", scale[d]), ("scale_inv", scale_inv[d])):
            if t is None:
                continue
            ok = torch.isfinite(t) & (t > 0)
            if not bool(ok.all()):
                raise _err(
                    f"{name}_{d}",
                    f"a value of {_first_bad(t, ok)!r}",
                    "finite values > 0",
                    "The run had diverged when it was saved; use an earlier checkpoint.",
                )
        ok = torch.isfinite(history[d]) & (history[d] >= 0)
        if not bool(ok.all()):
            raise _err(
                f"amax_history_{d}",
                f"an amax of {_first_bad(history[d], ok)!r}",
                "finite values >= 0",
                "The run had overflowed when it was saved; use an earlier checkpoint.",
            )


def _layout(n_fwd: int, n_bwd: int) -> tuple[bool, int]:
    """(old 2/1 layout?, GEMM count) from the slot counts; the two layouts never collide."""
    if n_fwd == 2 * n_bwd:
        return True, n_bwd
    if 2 * n_fwd == 3 * n_bwd:
        return False, n_fwd // 3
    raise _err(
        "scale_bwd",
        f"{n_fwd} forward and {n_bwd} backward FP8 tensors",
        "3 forward / 2 backward per GEMM (TE v0.6+) or 2 / 1 (TE v0.1-v0.5)",
    )


def _tensors(code: str, items: dict[str, Any], efv: Mapping[str, Any], **extra: Any) -> TEState:
    """Validate the four (or six) tensors of a value and build its :class:`TEState`."""
    sf = _tensor(items["scale_fwd"], "scale_fwd", 1)
    sb = _tensor(items["scale_bwd"], "scale_bwd", 1)
    hf = _tensor(items["amax_history_fwd"], "amax_history_fwd", 2)
    hb = _tensor(items["amax_history_bwd"], "amax_history_bwd", 2)
    for hist, s, d in ((hf, sf, "fwd"), (hb, sb, "bwd")):
        if s.numel() == 0 or hist.shape[0] == 0 or hist.shape[1] != s.shape[0]:
            raise _err(
                f"amax_history_{d}",
                f"shape {tuple(hist.shape)} beside scale_{d} {tuple(s.shape)}",
                f"(L >= 1, {s.shape[0]}) with at least one tensor",
            )
    if hf.shape[0] != hb.shape[0]:
        raise _err("amax_history_bwd", f"{hb.shape[0]} rows", f"{hf.shape[0]} rows like fwd")
    inv: dict[str, torch.Tensor | None] = {"fwd": None, "bwd": None}
    if (items.get("scale_inv_fwd") is None) != (items.get("scale_inv_bwd") is None):
        raise _err("scale_inv_bwd", "only one direction's scale_inv", "both or neither")
    if items.get("scale_inv_fwd") is not None:
        for d, s in (("fwd", sf), ("bwd", sb)):
            t = _tensor(items[f"scale_inv_{d}"], f"scale_inv_{d}", 1)
            if t.shape != s.shape:
                raise _err(
                    f"scale_inv_{d}", f"shape {tuple(t.shape)}", f"{tuple(s.shape)} like scale_{d}"
                )
            inv[d] = t
    old, gemms = _layout(sf.shape[0], sb.shape[0])
    if code == "E03" and not old:
        code = "E04"  # an E04 dict that was unpickled before it reached us
    the_era = era(code)
    if old != the_era.old_slot_layout:
        raise _err(
            "scale_fwd",
            f"{sf.shape[0]} forward / {sb.shape[0]} backward FP8 tensors",
            f"{the_era.fwd_per_gemm} / {the_era.bwd_per_gemm} per GEMM, as TE "
            f"{the_era.te_tags} ({code}) stores them",
        )
    scale, history = {"fwd": sf, "bwd": sb}, {"fwd": hf, "bwd": hb}
    _check_values(scale, inv, history)
    maxima = (efv.get("fp8_max_fwd"), efv.get("fp8_max_bwd"))
    return TEState(
        era=the_era,
        scale=scale,
        scale_inv=inv,
        amax_history=history,
        num_gemms=gemms,
        te_num_gemms=_int_or_none(efv, "num_gemms"),
        fp8_max=None if maxima == (None, None) else maxima,
        **extra,
    )


def _decode_list(items: list[Any]) -> TEState:
    """E01 (TE v0.1-v0.2): a list of 10 items.

    ``[scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd, global buffer, update flag,
    buffer pos fwd, buffer pos bwd, autocast id fwd, autocast id bwd]``.
    """
    if len(items) != 10:
        raise _err("", f"a list of {len(items)} items", "the 10-item list of TE v0.1-v0.2")
    named = dict(zip(_TENSOR_KEYS, items[:4], strict=True))
    return _tensors("E01", named, {}, dropped=("global amax buffer", "autocast counters"))


def _decode_recipe_dict(obj: Mapping[str, Any], efv: Mapping[str, Any]) -> TEState | NoFP8State:
    """E08-E10 (TE v2.0+): ``{"recipe": <obj>, [scale/amax tensors], "extra_fp8_variables"}``."""
    recipe = obj["recipe"]
    if not isinstance(recipe, standins.TERecipe):
        raise _err("recipe", f"a {type(recipe).__name__}", "a pickled TE recipe object")
    present = [k for k in _TENSOR_KEYS if k in obj]
    if isinstance(recipe, standins.DELAYED_SCALING) or present:
        if not isinstance(recipe, standins.DELAYED_SCALING):
            raise _err(
                "recipe",
                f"a {recipe.te_name} recipe beside FP8 scaling tensors",
                "DelayedScaling, the only recipe TE stores tensors for",
            )
        missing = [k for k in _TENSOR_KEYS if k not in obj]
        if missing:
            raise _err(missing[0], "no such key", "the four delayed-scaling tensors")
        return _tensors("E08-E10", dict(obj), efv, recipe=recipe)
    # Stateless recipes (current / block scaling) keep nothing between steps (PR #3123).
    return NoFP8State(
        "E08-E10", f"stateless recipe {recipe.te_name}", _int_or_none(efv, "num_gemms"), recipe
    )


def _decode_dict(container: str, obj: Mapping[Any, Any]) -> TEState | NoFP8State:
    bad = [k for k in obj if not isinstance(k, str)]  # a None key is a bad key too
    if bad:
        raise _err("", f"a dict key of type {type(bad[0]).__name__}", "string keys")
    keys = set(obj)
    if not keys or keys <= _OPS_KEYS:
        if all(v is None or (isinstance(v, Mapping) and not v) for v in obj.values()):
            return NoFP8State("ops", "ops-based module (te.ops / LayerNorm / RMSNorm), no state")
        raise _err(
            "",
            f"an ops-based (te.ops / te.Sequential) state with keys {sorted(keys)}",
            "a module-based TE extra state (Linear, LayerNormLinear, LayerNormMLP, attention)",
            "FP8 state of te.ops operations is not supported; see docs/migration.md.",
        )
    efv = obj.get("extra_fp8_variables", {})
    if not isinstance(efv, Mapping):
        raise _err("extra_fp8_variables", f"a {type(efv).__name__}", "a dict")
    if "recipe" in keys:
        return _decode_recipe_dict(obj, efv)
    missing = [k for k in _TENSOR_KEYS if k not in keys]
    if missing:
        raise _err(
            missing[0],
            f"a dict with keys {sorted(keys)[:8]}",
            "a TE extra state (scale_fwd, amax_history_fwd, ...) or an fp8state payload "
            "(with schema_version)",
            "This is neither a TransformerEngine nor an fp8state extra state.",
        )
    dropped = tuple(
        k
        for k in ("global_fp8_buffer", "global_fp8_recompute_buffer", "global_fp8_state")
        if k in keys
    )
    return _tensors(era_of_dict(container, keys), dict(obj), efv, dropped=dropped)


def _no_state(container: str) -> NoFP8State:
    if container == containers.NONE:
        return NoFP8State("E01-E03", "FP8 never ran (None)")
    if container == containers.PICKLE:
        return NoFP8State("E04/E05/E08", "FP8 never ran (pickled None)")
    if container == containers.BYTESIO:
        return NoFP8State("E06/E07", "FP8 never ran (torch.save of None)")
    if container == f"{containers.EMPTY} (uint8)":
        return NoFP8State("E09/E10", "FP8 never ran, or a stateless recipe (empty tensor)")
    return NoFP8State("ops v1.13", "ops-based module (LayerNorm/RMSNorm), no state")


def decode_opened(opened: containers.Opened) -> TEState | NoFP8State:
    """Decode the object inside a TE extra state (see the module docstring for the eras).

    Raises:
        LegacyFormatError: wrong structure, malformed shapes, non-finite or non-positive scales,
            non-finite or negative amaxes.
    """
    obj = opened.obj
    if obj is None:
        return _no_state(opened.container)
    if opened.container == containers.LIST:
        return _decode_list(obj)
    if isinstance(obj, Mapping):
        return _decode_dict(opened.container, obj)
    raise _err(
        "",
        f"{opened.container} holding a {type(obj).__name__}",
        "a dict of TE's FP8 metadata, or None",
    )
