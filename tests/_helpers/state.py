"""Bit-exact comparisons: tensors, payloads and state dicts (``assert_same``), two modules' FP8
state (``assert_state_equal``), and a module before and after (``snapshot``/``assert_unchanged``).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

import fp8state
from _helpers.models import FP8_BUFFERS, mixin_modules
from _helpers.numerics import bits


def assert_same(
    a: Any,
    b: Any,
    *,
    ordered: bool = False,
    exact_types: bool = False,
    nan_ok: bool = False,
    device: str | None = None,
    where: str = "",
) -> None:
    """Assert that ``b`` is ``a``'s value bit for bit, through nested mappings and sequences.

    - Tensors: the same dtype, shape and device, and the same bytes (so -0.0 != 0.0); unless
      ``nan_ok``, also equal values (``torch.equal``: a NaN fails even where both hold it).
      Meta and sparse tensors: dtype, shape and device only.
    - Mappings: the same keys (in the same order with ``ordered``), then key by key.
    - Lists and tuples: the same length, then item by item. ``io.BytesIO``: the same bytes.
      NumPy arrays: ``np.array_equal``. Anything else: ``==``.
    - ``exact_types``: ``type(a) is type(b)`` at every level. ``device``: every tensor of ``a``
      is on a device of this type.

    ``nan_ok`` is for copies of corrupt payloads (``corruptions.copy_payload``), which may hold
    NaN on purpose; ``where`` names the place in messages.
    """
    kw = {"ordered": ordered, "exact_types": exact_types, "nan_ok": nan_ok, "device": device}
    if exact_types:
        assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), (where, type(b))
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (
            where,
            (a.dtype, a.shape, a.device),
            (b.dtype, b.shape, b.device),
        )
        if device is not None:
            assert a.device.type == device, (where, a.device)
        if a.layout == torch.strided and not a.is_meta:
            assert torch.equal(bits(a), bits(b)), f"{where}: the bytes differ"
            if not nan_ok:
                assert torch.equal(a, b), f"{where}: the values differ (or hold NaN)"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), (where, type(b))
        if ordered:
            assert list(a) == list(b), (where, list(a), list(b))
        else:
            assert a.keys() == b.keys(), (where, sorted(map(str, a)), sorted(map(str, b)))
        for key in a:
            assert_same(a[key], b[key], **kw, where=f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, **kw, where=f"{where}[{i}]")
    elif isinstance(a, io.BytesIO):
        assert isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue(), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, (where, a, b)


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
            torch.testing.assert_close(
                ta,
                tb,
                atol=0,
                rtol=0,
                equal_nan=False,
                msg=lambda m, w=where, k=buf: f"{w}.{k}: {m}",
            )
        ea, eb = fields(a.get_extra_state()), fields(b.get_extra_state())
        assert ea.keys() == eb.keys(), (where, sorted(ea), sorted(eb))
        for key in ea:
            assert ea[key].dtype == eb[key].dtype, (where, key)
            assert torch.equal(ea[key], eb[key]), (where, key)


def fp8_payloads(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``get_extra_state()`` of every mixin module of ``model``, by name, cloned."""
    return {
        name: {k: v.clone() for k, v in fields(m.get_extra_state()).items()}
        for name, m in mixin_modules(model).items()
    }


def fields(payload: Any) -> dict[str, torch.Tensor]:
    """A payload's fields by key (``fp8state.schema.as_mapping``; validates it)."""
    return fp8state.schema.as_mapping(payload)


def live_payload(module: fp8state.FP8StateMixin, rows: int) -> dict[str, torch.Tensor]:
    """A payload-shaped view of ``module``'s live metadata, its histories cut to ``rows``."""
    out = {
        f"{d}.{f}": getattr(module.fp8_meta(d), f)
        for d in ("fwd", "bwd")
        for f in ("scale", "scale_inv")
    }
    out.update(
        {f"{d}.amax_history": module.fp8_meta(d).amax_history[:rows] for d in ("fwd", "bwd")}
    )
    out.update({f"recipe.{k}": torch.tensor(v) for k, v in module.fp8_recipe.to_scalars().items()})
    return out


def sub_state_dict(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries under ``prefix``, with the prefix removed (one module's state dict)."""
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


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
        "new_step": {n: m._fp8_step_flags() for n, m in _fp8_modules(module).items()},
    }


def assert_unchanged(module: nn.Module, before: dict[str, Any]) -> None:
    """Assert ``module`` matches :func:`snapshot` output bit for bit (same tensor objects too)."""
    after = snapshot(module)
    assert after["tensors"].keys() == before["tensors"].keys()
    for key, (dev, dtype, shape, data) in before["tensors"].items():
        dev2, dtype2, shape2, data2 = after["tensors"][key]
        assert (dev2, dtype2, shape2) == (dev, dtype, shape), key
        if data is not None:
            assert torch.equal(bits(data), bits(data2)), f"{key} changed"
    assert after["identity"] == before["identity"], "a parameter or buffer was replaced"
    assert after["recipes"] == before["recipes"], "fp8_recipe changed"
    assert after["new_step"] == before["new_step"], "step flag changed"
