"""Helpers shared by the tests: SQNR, bit-exact FP8-state comparison, a two-GEMM mixin module.

Import as ``from _utils import ...``: ``tests/`` has no ``__init__.py``, so pytest puts it on
``sys.path`` (the same way it loads ``conftest.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import fp8state
from fp8state.errors import FP8StateError, SchemaError, SchemaVersionError
from fp8state.recipe import DelayedScaling
from fp8state.schema import default_payload
from fp8state.slots import FwdSlot, fwd_slot

__all__ = [
    "sqnr",
    "TwoGemm",
    "make_two_gemm",
    "make_model",
    "mixin_modules",
    "run_steps",
    "assert_state_equal",
    "snapshot",
    "assert_unchanged",
    "FP8_BUFFERS",
    "KEYS_V1",
    "Mutation",
    "CORRUPTIONS",
    "copy_payload",
    "assert_same_payload",
    "assert_state_dicts_equal",
]

FP8_BUFFERS = tuple(
    f"fp8_{d}_{f}" for d in ("fwd", "bwd") for f in ("amax_history", "scale", "scale_inv")
)


def sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``y`` against reference ``x``, in dB.

    ``20 * log10(||x|| / ||x - y||)`` (torchao's ``compute_error``); ``inf`` when equal.
    """
    x, y = x.detach().double(), y.detach().double()
    noise = torch.linalg.vector_norm(x - y)
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(x) / noise))


class TwoGemm(fp8state.FP8StateMixin):
    """``y = (x @ w1.T) @ w2.T`` in high precision; the forward records the 6 forward amaxes.

    Enough of a module to own FP8 metadata for two GEMMs (6 forward, 4 backward slots) and
    exercise checkpoints; it does not quantize.
    """

    def __init__(
        self,
        hidden: int = 4,
        *,
        history_rows: int = 16,
        recipe: DelayedScaling | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(hidden, hidden, device=device))
        self.w2 = nn.Parameter(torch.randn(hidden, hidden, device=device))
        self.register_buffer("step_count", torch.zeros((), dtype=torch.int64, device=device))
        self.init_fp8_meta(num_gemms=2, history_rows=history_rows, recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1.T
        y = h @ self.w2.T
        for gemm, (inp, w, out) in enumerate(((x, self.w1, h), (h, self.w2, y))):
            self.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.INPUT), inp.abs().amax())
            self.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.WEIGHT), w.abs().amax())
            self.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.OUTPUT), out.abs().amax())
        return y


def make_two_gemm(**kwargs: Any) -> TwoGemm:
    """A :class:`TwoGemm` (keyword arguments as its constructor's)."""
    return TwoGemm(**kwargs)


def make_model(n_blocks: int = 2, **kwargs: Any) -> nn.Module:
    """A model of several mixin modules under prefixes ``blocks.{i}`` plus one plain Linear."""
    model = nn.Module()
    model.blocks = nn.ModuleList(TwoGemm(**kwargs) for _ in range(n_blocks))
    model.head = nn.Linear(kwargs.get("hidden", 4), 2, device=kwargs.get("device"))
    return model


def mixin_modules(model: nn.Module) -> dict[str, fp8state.FP8StateMixin]:
    """Every FP8StateMixin in ``model`` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, fp8state.FP8StateMixin)}


def run_steps(model: nn.Module, steps: int, *, seed: int = 0) -> None:
    """Give every mixin module of ``model`` a non-trivial history: ``steps`` steps of random
    amaxes in every slot of both directions, each step ending with a scale update.

    Amaxes span many binades (2**-20 .. 2**20), so scales exercise the full float32 mantissa.
    """
    gen = torch.Generator().manual_seed(seed)
    for module in mixin_modules(model).values():
        device = module.fp8_meta("fwd").scale.device
        for _ in range(steps):
            for direction in ("fwd", "bwd"):
                n = module.fp8_meta(direction).scale.numel()
                amax = torch.exp2(torch.rand(n, generator=gen) * 40 - 20).to(device)
                for slot in range(n):
                    module.fp8_record_amax(direction, slot, amax[slot])
                module.fp8_update_scales(direction)


def _fp8_modules(module: nn.Module) -> dict[str, fp8state.FP8StateMixin]:
    if isinstance(module, fp8state.FP8StateMixin):
        return {"": module, **{k: v for k, v in mixin_modules(module).items() if k}}
    return mixin_modules(module)


def assert_state_equal(module_a: nn.Module, module_b: nn.Module) -> None:
    """Assert that the FP8 metadata of two modules (or models) is bit-for-bit the same.

    Compares, for every mixin module (matched by qualified name): the six buffers (dtype, shape,
    bits), the recipe, and ``get_extra_state()`` key by key. Devices may differ.
    """
    mods_a, mods_b = _fp8_modules(module_a), _fp8_modules(module_b)
    assert mods_a.keys() == mods_b.keys(), (sorted(mods_a), sorted(mods_b))
    for name, a in mods_a.items():
        b = mods_b[name]
        where = name or "<root>"
        assert a.fp8_recipe == b.fp8_recipe, (where, a.fp8_recipe, b.fp8_recipe)
        for buf in FP8_BUFFERS:
            ta, tb = getattr(a, buf).cpu(), getattr(b, buf).cpu()
            assert ta.dtype == tb.dtype == torch.float32, (where, buf, ta.dtype, tb.dtype)
            torch.testing.assert_close(ta, tb, atol=0, rtol=0, equal_nan=False,
                                       msg=lambda m, w=where, k=buf: f"{w}.{k}: {m}")
        ea, eb = a.get_extra_state(), b.get_extra_state()
        assert ea.keys() == eb.keys(), (where, sorted(ea), sorted(eb))
        for key in ea:
            assert ea[key].dtype == eb[key].dtype, (where, key)
            assert torch.equal(ea[key], eb[key]), (where, key)


def snapshot(module: nn.Module) -> dict[str, Any]:
    """Everything a failed load must not change: every parameter and buffer (persistent or
    not, by qualified name, with device, dtype and bits), and every mixin's recipe and
    step flag."""
    tensors = {
        **{f"param:{n}": t for n, t in module.named_parameters()},
        **{f"buffer:{n}": t for n, t in module.named_buffers()},
    }
    return {
        "tensors": {
            k: (t.device, t.dtype, t.shape, None if t.is_meta else t.detach().cpu().clone())
            for k, t in tensors.items()
        },
        "identity": {k: id(t) for k, t in tensors.items()},
        "recipes": {n: m.fp8_recipe for n, m in _fp8_modules(module).items()},
        "new_step": {n: copy.deepcopy(m._fp8_new_step) for n, m in _fp8_modules(module).items()},
    }


def assert_unchanged(module: nn.Module, before: dict[str, Any]) -> None:
    """Assert ``module`` matches :func:`snapshot` output bit for bit (same tensor objects too)."""
    after = snapshot(module)
    assert after["tensors"].keys() == before["tensors"].keys()
    for key, (dev, dtype, shape, data) in before["tensors"].items():
        dev2, dtype2, shape2, data2 = after["tensors"][key]
        assert (dev2, dtype2, shape2) == (dev, dtype, shape), key
        if data is not None:
            assert torch.equal(_bits(data), _bits(data2)), f"{key} changed"
    assert after["identity"] == before["identity"], "a parameter or buffer was replaced"
    assert after["recipes"] == before["recipes"], "fp8_recipe changed"
    assert after["new_step"] == before["new_step"], "step flag changed"


# ---------------------------------------------------------------- payload corruptions

KEYS_V1 = frozenset({
    "schema_version",
    "fwd.amax_history", "fwd.scale", "fwd.scale_inv",
    "bwd.amax_history", "bwd.scale", "bwd.scale_inv",
    "recipe.fp8_format", "recipe.margin", "recipe.amax_history_len", "recipe.amax_compute_algo",
})

#: Takes a valid payload (a fresh dict the mutation may edit), returns the corrupted input.
Mutation = Callable[[dict[str, Any]], Any]


def _set(key: Any, value: Any) -> Mutation:
    """``p[key] = value`` (``value(p)`` if callable)."""
    def mutate(p: dict[str, Any]) -> dict[str, Any]:
        p[key] = value(p) if callable(value) else value
        return p
    return mutate


def _drop(key: str) -> Mutation:
    def mutate(p: dict[str, Any]) -> dict[str, Any]:
        del p[key]
        return p
    return mutate


def _poke(key: str, value: float) -> Mutation:
    """A copy of ``p[key]`` with its last element set to ``value``."""
    def mutate(p: dict[str, Any]) -> dict[str, Any]:
        t = p[key].clone()
        t.view(-1)[-1] = value
        p[key] = t
        return p
    return mutate


def _whole(value: Any) -> Mutation:
    return lambda p: value() if callable(value) else value


def _rows(p: dict[str, Any]) -> int:
    return int(p["fwd.amax_history"].shape[0])


def _n(p: dict[str, Any], d: str) -> int:
    return int(p[f"{d}.scale"].numel())


def _other_gemms(p: dict[str, Any]) -> dict[str, Any]:
    other = default_payload(num_gemms=_n(p, "fwd") // 3 + 1, rows=_rows(p))
    return {**p, **{k: v for k, v in other.items() if k.startswith(("fwd.", "bwd."))}}


def _bwd_slots(extra: int) -> Mutation:
    def mutate(p: dict[str, Any]) -> dict[str, Any]:
        n = _n(p, "bwd") + extra
        return {**p, "bwd.amax_history": torch.zeros(_rows(p), n),
                "bwd.scale": torch.ones(n), "bwd.scale_inv": torch.ones(n)}
    return mutate


NAN, INF = float("nan"), float("inf")
T = torch.tensor

#: Every kind of bad input of the acceptance list, as (test id, mutation, error class, text the
#: error's key must contain). Generic: applies to any valid payload of any GEMM and row count.
CORRUPTIONS: list[tuple[str, Mutation, type[FP8StateError], str]] = [
    # not a dict
    ("nondict-list", _whole(lambda: [T(1)]), SchemaError, ""),
    ("nondict-none", _whole(None), SchemaError, ""),
    ("nondict-tensor", _whole(lambda: T(1)), SchemaError, ""),
    ("nondict-te-uint8", _whole(lambda: torch.zeros(4, dtype=torch.uint8)), SchemaError, ""),
    ("nondict-bytes", _whole(b"\x80\x04N."), SchemaError, ""),
    ("nondict-str", _whole("fwd.scale"), SchemaError, ""),
    # keys
    *[(f"missing-{k}", _drop(k), SchemaError, k) for k in sorted(KEYS_V1)],
    ("extra-key", _set("fwd.amax", lambda p: torch.zeros(3)), SchemaError, "fwd.amax"),
    ("extra-key-metadata", _set("__metadata__", lambda p: T(0)), SchemaError, "__metadata__"),
    ("nonstr-key", _set(0, lambda p: T(0)), SchemaError, "0"),
    # extra structure, non-tensor values
    ("nested-dict", _set("fwd", lambda p: {"scale": torch.ones(3)}), SchemaError, "fwd"),
    ("nested-dict-value", _set("fwd.scale", lambda p: {"v": p["fwd.scale"]}), SchemaError,
     "fwd.scale"),
    ("nested-list-value", _set("fwd.scale", lambda p: [p["fwd.scale"]]), SchemaError,
     "fwd.scale"),
    ("value-list", _set("fwd.scale", lambda p: p["fwd.scale"].tolist()), SchemaError,
     "fwd.scale"),
    ("value-int", _set("recipe.margin", 1), SchemaError, "recipe.margin"),
    ("value-float", _set("fwd.scale", 1.0), SchemaError, "fwd.scale"),
    ("value-none", _set("bwd.scale_inv", None), SchemaError, "bwd.scale_inv"),
    ("value-str", _set("schema_version", "1"), SchemaError, "schema_version"),
    ("value-numpy", _set("fwd.scale", lambda p: p["fwd.scale"].numpy()), SchemaError,
     "fwd.scale"),
    ("value-bytes", _set("fwd.amax_history", b"\x00"), SchemaError, "fwd.amax_history"),
    # meta and sparse tensors
    ("meta-scale", _set("fwd.scale", lambda p: p["fwd.scale"].to("meta")), SchemaError,
     "fwd.scale"),
    ("meta-history", _set("bwd.amax_history", lambda p: p["bwd.amax_history"].to("meta")),
     SchemaError, "bwd.amax_history"),
    ("meta-version", _set("schema_version", lambda p: T(1, device="meta")), SchemaError,
     "schema_version"),
    ("sparse-history", _set("fwd.amax_history", lambda p: p["fwd.amax_history"].to_sparse()),
     SchemaError, "fwd.amax_history"),
    # dtypes
    ("dtype-scale-f64", _set("fwd.scale", lambda p: p["fwd.scale"].double()), SchemaError,
     "fwd.scale"),
    ("dtype-scale-bf16", _set("bwd.scale", lambda p: p["bwd.scale"].bfloat16()), SchemaError,
     "bwd.scale"),
    ("dtype-scale_inv-i64", _set("fwd.scale_inv", lambda p: p["fwd.scale_inv"].long()),
     SchemaError, "fwd.scale_inv"),
    ("dtype-history-f16", _set("bwd.amax_history", lambda p: p["bwd.amax_history"].half()),
     SchemaError, "bwd.amax_history"),
    ("dtype-version-i32", _set("schema_version", lambda p: T(1, dtype=torch.int32)),
     SchemaError, "schema_version"),
    ("dtype-version-f32", _set("schema_version", lambda p: T(1.0)), SchemaError,
     "schema_version"),
    ("dtype-margin-f32", _set("recipe.margin", lambda p: T(0.0)), SchemaError, "recipe.margin"),
    ("dtype-format-bool", _set("recipe.fp8_format", lambda p: T(True)), SchemaError,
     "recipe.fp8_format"),
    # shapes and slot counts
    ("shape-version-1d", _set("schema_version", lambda p: T([1])), SchemaError,
     "schema_version"),
    ("shape-window-1d", _set("recipe.amax_history_len", lambda p: T([1])), SchemaError,
     "recipe.amax_history_len"),
    ("shape-scale-0d", _set("fwd.scale", lambda p: T(1.0)), SchemaError, "fwd.scale"),
    ("shape-scale-2d", _set("fwd.scale", lambda p: p["fwd.scale"][:, None]), SchemaError,
     "fwd.scale"),
    ("shape-scale-empty", _set("fwd.scale", lambda p: torch.ones(0)), SchemaError, "fwd.scale"),
    ("slots-fwd-not-multiple-of-3", _set("fwd.scale", lambda p: torch.ones(_n(p, "fwd") + 1)),
     SchemaError, "fwd.scale"),
    ("slots-bwd-not-multiple-of-2", _set("bwd.scale", lambda p: torch.ones(_n(p, "bwd") + 1)),
     SchemaError, "bwd.scale"),
    ("shape-scale_inv", _set("fwd.scale_inv", lambda p: torch.ones(_n(p, "fwd") + 3)),
     SchemaError, "fwd.scale_inv"),
    ("shape-history-1d", _set("fwd.amax_history", lambda p: torch.zeros(_n(p, "fwd"))),
     SchemaError, "fwd.amax_history"),
    ("shape-history-3d", _set("fwd.amax_history", lambda p: p["fwd.amax_history"][..., None]),
     SchemaError, "fwd.amax_history"),
    ("shape-history-cols",
     _set("fwd.amax_history", lambda p: torch.zeros(_rows(p), _n(p, "fwd") + 3)),
     SchemaError, "fwd.amax_history"),
    ("shape-history-0-rows", _set("fwd.amax_history", lambda p: torch.zeros(0, _n(p, "fwd"))),
     SchemaError, "fwd.amax_history"),
    ("rows-fwd-bwd-differ",
     _set("bwd.amax_history", lambda p: torch.zeros(_rows(p) + 1, _n(p, "bwd"))),
     SchemaError, "bwd.amax_history"),
    ("gemms-fwd-bwd-differ", _bwd_slots(2), SchemaError, "bwd.scale"),
    ("gemms-not-the-modules", _other_gemms, SchemaError, "fwd.scale"),
    # values
    ("scale-nan", _poke("fwd.scale", NAN), SchemaError, "fwd.scale"),
    ("scale-neg", _poke("fwd.scale", -224.0), SchemaError, "fwd.scale"),
    ("scale-zero", _poke("bwd.scale", 0.0), SchemaError, "bwd.scale"),
    ("scale-neg-zero", _poke("bwd.scale", -0.0), SchemaError, "bwd.scale"),
    ("scale-inf", _poke("bwd.scale", INF), SchemaError, "bwd.scale"),
    ("scale_inv-nan", _poke("fwd.scale_inv", NAN), SchemaError, "fwd.scale_inv"),
    ("scale_inv-zero", _poke("bwd.scale_inv", 0.0), SchemaError, "bwd.scale_inv"),
    ("scale_inv-inf", _poke("bwd.scale_inv", INF), SchemaError, "bwd.scale_inv"),
    ("history-nan", _poke("fwd.amax_history", NAN), SchemaError, "fwd.amax_history"),
    ("history-neg", _poke("bwd.amax_history", -1.0), SchemaError, "bwd.amax_history"),
    ("history-inf", _poke("bwd.amax_history", INF), SchemaError, "bwd.amax_history"),
    # recipe codes and window
    ("recipe-format-2", _set("recipe.fp8_format", lambda p: T(2)), SchemaError,
     "recipe.fp8_format"),
    ("recipe-format-neg", _set("recipe.fp8_format", lambda p: T(-1)), SchemaError,
     "recipe.fp8_format"),
    ("recipe-algo-2", _set("recipe.amax_compute_algo", lambda p: T(2)), SchemaError,
     "recipe.amax_compute_algo"),
    ("recipe-margin-neg", _set("recipe.margin", lambda p: T(-1)), SchemaError, "recipe.margin"),
    ("recipe-window-0", _set("recipe.amax_history_len", lambda p: T(0)), SchemaError,
     "recipe.amax_history_len"),
    ("recipe-window-gt-rows", _set("recipe.amax_history_len", lambda p: T(_rows(p) + 1)),
     SchemaError, "recipe.amax_history_len"),
    # versions
    ("version-0", _set("schema_version", lambda p: T(0)), SchemaVersionError, "schema_version"),
    ("version-2", _set("schema_version", lambda p: T(2)), SchemaVersionError, "schema_version"),
    ("version-99", _set("schema_version", lambda p: T(99)), SchemaVersionError,
     "schema_version"),
    ("version-neg", _set("schema_version", lambda p: T(-7)), SchemaVersionError,
     "schema_version"),
]


def copy_payload(payload: Any) -> Any:
    """A deep copy of a (possibly corrupt) payload, for checking it was not written to."""
    if isinstance(payload, torch.Tensor):
        return payload.clone() if payload.layout == torch.strided else payload
    if isinstance(payload, dict):
        return {k: copy_payload(v) for k, v in payload.items()}
    return copy.copy(payload)


def assert_same_payload(a: Any, b: Any) -> None:
    """Bit-for-bit equality of two payloads as :func:`copy_payload` makes them."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape, a.device) == (
            b.dtype, b.shape, b.device)
        if a.layout == torch.strided and not a.is_meta:
            assert torch.equal(_bits(a), _bits(b))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same_payload(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def assert_state_dicts_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same keys, and the same dtype and values under each (nested dicts: extra states)."""
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_state_dicts_equal(a[key], b[key])
        else:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so NaN == NaN and -0.0 != 0.0)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
