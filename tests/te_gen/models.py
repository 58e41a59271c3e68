"""Whole TE-shaped state dicts: modules with TE's parameter names for the era, and their extra
states (te_formats.md, section 8), saved the way a GPU run saves them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from te_gen.payloads import OLD_LAYOUT, Spec, Truth, extra_state
from te_gen.tepickle import as_uint8, saved_on

#: GEMMs per module kind (te_formats.md, section 4).
GEMMS = {"Linear": 1, "LayerNormLinear": 1, "QKV": 1, "LayerNormMLP": 2, "DotProductAttention": 3}
NORMS = ("LayerNorm", "RMSNorm")


@dataclass
class Module:
    """One module to generate: where, what, how big, and its FP8 settings."""

    prefix: str
    kind: str
    hidden: int = 8
    out: int = 12
    bias: bool = True
    spec: Spec = field(default_factory=Spec)
    groups: int = 3  # GroupedLinear only


@dataclass
class Generated:
    """A generated state dict and the truth about each module's FP8 state."""

    era: str
    state_dict: OrderedDict[str, Any]
    truths: dict[str, Truth | None]
    modules: dict[str, Module]
    on_gpu: list[torch.Tensor] = field(default_factory=list)


def _p(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * 0.02


def _params(m: Module, era: str, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    h, o = m.hidden, m.out
    ln = [("layer_norm_weight", 1 + _p(gen, h)), ("layer_norm_bias", _p(gen, h))]
    if m.kind == "Linear":
        return [("weight", _p(gen, o, h))] + ([("bias", _p(gen, o))] if m.bias else [])
    if m.kind == "LayerNormLinear":
        return ln + [("weight", _p(gen, o, h))] + ([("bias", _p(gen, o))] if m.bias else [])
    if m.kind == "QKV":  # TransformerLayer's layernorm_qkv with split parameters
        if era in OLD_LAYOUT:
            return ln  # v0.1-v0.5: the q/k/v weights live on the attention module
        w = [(f"{n}_weight", _p(gen, h, h)) for n in ("query", "key", "value")]
        b = [(f"{n}_bias", _p(gen, h)) for n in ("query", "key", "value")]
        interleaved = era in ("E04", "E05", "E06", "E07")  # v0.6-v1.7; v1.8+ weights first
        return ln + ([x for pair in zip(w, b, strict=True) for x in pair] if interleaved else w + b)
    if m.kind == "LayerNormMLP":
        return ln + [
            ("fc1_weight", _p(gen, o, h)),
            ("fc1_bias", _p(gen, o)),
            ("fc2_weight", _p(gen, h, o)),
            ("fc2_bias", _p(gen, h)),
        ]
    if m.kind == "GroupedLinear":
        return [(f"weight{i}", _p(gen, o, h)) for i in range(m.groups)] + [
            (f"bias{i}", _p(gen, o)) for i in range(m.groups)
        ]
    if m.kind in NORMS:
        weight = [("weight", 1 + _p(gen, h))]
        return weight + ([("bias", _p(gen, h))] if m.kind == "LayerNorm" else [])
    return []  # DotProductAttention: no parameters


def _norm_extra_state(era: str) -> Any:
    """Ops-based norms: absent before v1.13, then empty float32, pickled {}, empty uint8."""
    if era == "E07":
        return torch.Tensor()
    if era == "E08":
        return as_uint8(b"\x80\x04}\x94.")
    if era in ("E09", "E10"):
        return torch.empty(0, dtype=torch.uint8)
    return None


def build(era: str, modules: list[Module], seed: int = 0) -> Generated:
    """Generate the state dict ``torch.save(model.state_dict())`` of TE ``era`` would hold."""
    gen = torch.Generator().manual_seed(seed)
    sd: OrderedDict[str, Any] = OrderedDict()
    sd._metadata = OrderedDict()  # type: ignore[attr-defined]
    out = Generated(era, sd, {}, {})
    fp8_mods = [m for m in modules if m.kind not in NORMS and m.spec.fp8]
    step = max((m.spec.steps for m in fp8_mods), default=1)
    old = era in OLD_LAYOUT
    gbuf = {
        f"FWD_AMAX_{step}": [torch.rand(_n(m, old, "fwd"), generator=gen) for m in fp8_mods],
        f"BWD_AMAX_{step}": [torch.rand(_n(m, old, "bwd"), generator=gen) for m in fp8_mods[::-1]],
    }
    for pos, m in enumerate(modules):
        out.modules[m.prefix] = m
        sd._metadata[m.prefix.rstrip(".")] = {"version": 1}  # type: ignore[attr-defined]
        for name, t in _params(m, era, gen):
            sd[f"{m.prefix}{name}"] = t
        if m.kind in NORMS:
            value = _norm_extra_state(era)
            if value is not None:
                sd[f"{m.prefix}_extra_state"] = value
            continue
        if m.kind == "GroupedLinear":
            m.spec.num_gemms = m.groups
        else:
            m.spec.num_gemms = GEMMS[m.kind]
        value, truth = extra_state(era, m.spec, pos=pos, gbuf=gbuf)
        sd[f"{m.prefix}_extra_state"] = value
        out.truths[m.prefix] = truth
        if old and truth is not None:
            out.on_gpu += [
                truth.fwd.scale,
                truth.fwd.amax_history,
                truth.bwd.scale,
                truth.bwd.amax_history,
            ]
    if old:
        out.on_gpu += [t for ts in gbuf.values() for t in ts]
    return out


def _n(m: Module, old: bool, direction: str) -> int:
    gemms = m.groups if m.kind == "GroupedLinear" else GEMMS.get(m.kind, 1)
    per = (2 if direction == "fwd" else 1) if old else (3 if direction == "fwd" else 2)
    return gemms * per


def save(
    generated: Generated, path: Any, *, wrap: str | None = None, params_on: str = "cuda:0"
) -> Any:
    """``torch.save`` the state dict as a GPU run would: parameters and (E01-E03) the FP8
    tensors tagged ``params_on``/``cuda:0``. ``wrap="model"`` nests it as training scripts do.
    """
    obj: Any = generated.state_dict
    if wrap is not None:
        obj = {
            wrap: obj,
            "optimizer": {
                "state": {0: {"step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 1e-3, "params": [0]}],
            },
            "iteration": 7,
            "note": "generated by te_gen",
        }
    params = [
        v
        for k, v in generated.state_dict.items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    ]
    with saved_on(params_on, params), saved_on("cuda:0", generated.on_gpu):
        torch.save(obj, path)
    return obj
