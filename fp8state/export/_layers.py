"""Which layers an export converts: each FP8 GEMM's weight, its input history and its name.

From a model, by module type: ``Linear`` and ``LayerNormLinear`` export one layer at the
module's name (a ``LayerNormLinear`` that ``convert_model`` fused sits at the original
``nn.Linear``'s name, and its norm goes back to the original norm's name, as in
``to_plain_state_dict``); ``LayerNormMLP`` exports two, under its own names ``<name>.fc1`` and
``<name>.fc2``. ``Conv1D`` (GPT-2's layout) and modules of other types are not converted.
From a flat state dict (what the CLI reads), by keys: ``<m>._extra_state`` with one GEMM and a
2-D ``<m>.weight`` is a linear layer, with two GEMMs and ``<m>.fc1_weight``/``<m>.fc2_weight``
a ``LayerNormMLP``; other modules are not converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fp8state.checkpoint import plain_names, to_plain_state_dict
from fp8state.errors import ExportError, FP8StateError
from fp8state.mixin import FP8StateMixin
from fp8state.modules import LayerNormLinear, LayerNormMLP, Linear
from fp8state.recipe import DelayedScaling
from fp8state.schema import is_extra_state_key, unpack
from fp8state.slots import FwdSlot, fwd_slot

__all__ = ["Layer", "Plan", "plan_from_model", "plan_from_state_dict", "GEMM_MULTIPLE", "join"]

#: FP8 GEMMs (``torch._scaled_mm``) need both weight dimensions to be multiples of 16.
GEMM_MULTIPLE = 16

_MLP = (("fc1_weight", "fc1_bias", "fc1"), ("fc2_weight", "fc2_bias", "fc2"))


def join(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` for the root module (whose prefix is empty)."""
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class Layer:
    """One linear layer to export.

    Attributes:
        name: Module name in the export (``weight``, ``weight_scale`` and ``input_scale``
            go under it).
        source: The fp8state module it comes from (named in errors).
        weight_key: The weight's key in the plain state dict (replaced by the FP8 weight).
        bias_key: The bias's key there, if it moves (``fc1_bias`` -> ``fc1.bias``).
        weight: ``(out_features, in_features)``.
        history: The forward input slot's amax history column, ``(rows,)``.
        stored_scale: That slot's current scale, ``(1,)``.
        recipe: The module's recipe.
    """

    name: str
    source: str
    weight_key: str
    bias_key: str | None
    weight: torch.Tensor
    history: torch.Tensor
    stored_scale: torch.Tensor
    recipe: DelayedScaling


@dataclass
class Plan:
    """What an export writes: the plain state dict, the layers to convert, what stays.

    Attributes:
        tensors: Every tensor of the model by its plain name, no FP8 metadata.
        layers: The layers converted to FP8.
        kept: FP8 modules not converted, with the reason, by name.
        unconverted: Linear layers left in the training dtype (a serving stack would
            otherwise take them for FP8 ones: they go into ``ignore``).
    """

    tensors: dict[str, torch.Tensor]
    layers: list[Layer]
    kept: dict[str, str]
    unconverted: set[str]


def _layer(
    name: str,
    source: str,
    weight_key: str,
    bias_key: str | None,
    weight: torch.Tensor,
    payload: object,
    gemm: int,
) -> Layer:
    try:  # validated whole: a zero or non-finite scale, a bad history, is refused here
        state = unpack(payload)
    except FP8StateError as err:
        raise ExportError(name, err.found, err.expected, err.fix) from None
    column = fwd_slot(gemm, FwdSlot.INPUT)
    fwd = state.direction("fwd")
    if weight.ndim != 2 or any(d % GEMM_MULTIPLE for d in weight.shape):
        raise ExportError(
            name,
            f"a weight of shape {tuple(weight.shape)}",
            f"both dimensions multiples of {GEMM_MULTIPLE}, as FP8 GEMMs (torch._scaled_mm) need",
            "Leave the module out of the export (exclude=[...]) or pad its features.",
        )
    return Layer(
        name=name,
        source=source,
        weight_key=weight_key,
        bias_key=bias_key,
        weight=weight,
        history=fwd.amax_history[:, column],
        stored_scale=fwd.scale[column : column + 1],
        recipe=state.recipe,
    )


def _owner(plain_key: str, leaf: str) -> str:
    """The plain module name of ``plain_key``, the key of its attribute ``leaf``."""
    return plain_key[: -len(leaf)].rstrip(".")


def _tied(model: nn.Module) -> set[int]:
    """Ids of parameters that more than one module holds (an ``lm_head`` tied to embeddings)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


def plan_from_model(model: nn.Module, exclude: set[str]) -> Plan:
    """The plan of a model holding fp8state modules (see the module docstring).

    Names are the plain ones ``to_plain_state_dict`` writes (no DDP or ``torch.compile``
    prefix). A layer whose weight is tied to another module's (an ``lm_head`` sharing the
    embeddings) is not converted: the tie holds in the export only in the training dtype.

    Args:
        model: The trained model.
        exclude: Plain module names to keep in the training dtype.
    """
    names = plain_names(model)
    tensors = to_plain_state_dict(model)
    tied = _tied(model)
    layers: list[Layer] = []
    kept: dict[str, str] = {}
    linears: set[str] = set()  # plain names of every Linear-like module, converted or not
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            linears.add(_owner(names[join(name, "weight")], "weight"))
        if not isinstance(module, FP8StateMixin) or not module.fp8_num_gemms:
            continue
        mlp = isinstance(module, LayerNormMLP)
        gemms = [(w, b, s) for w, b, s in _MLP] if mlp else [("weight", "bias", None)]
        plain = _owner(names[join(name, gemms[0][0])], gemms[0][0])
        targets = [join(plain, s) if s else plain for _, _, s in gemms]
        if not isinstance(module, (Linear, LayerNormLinear, LayerNormMLP)):
            kept[plain] = f"a {type(module).__name__}, not an nn.Linear layout"
            continue
        linears.update(targets)
        if plain in exclude:
            kept[plain] = "excluded"
            continue
        if any(id(getattr(module, w)) in tied for w, _, _ in gemms):
            kept[plain] = "its weight is tied to another module's"
            continue
        payload = module.get_extra_state()
        for gemm, ((weight, bias, _), target) in enumerate(zip(gemms, targets, strict=True)):
            bias_key = names.get(join(name, bias))
            layers.append(
                _layer(
                    target,
                    plain,
                    names[join(name, weight)],
                    bias_key if mlp and bias_key in tensors else None,
                    getattr(module, weight),
                    payload,
                    gemm,
                )
            )
    return Plan(tensors, layers, kept, linears - {layer.name for layer in layers})


def plan_from_state_dict(state: Mapping[str, object], exclude: set[str]) -> Plan:
    """The plan of a flat state dict with ``<module>._extra_state`` entries (the CLI's).

    Raises:
        ExportError: a value that is not a tensor, or FP8 metadata that does not decode.
    """
    tensors: dict[str, torch.Tensor] = {}
    payloads: dict[str, object] = {}
    for key, value in state.items():
        if is_extra_state_key(key):
            payloads[key.rsplit(".", 1)[0] if "." in key else ""] = value
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            raise ExportError(
                key,
                f"a {type(value).__name__}",
                "a tensor",
                "Export a model state dict (weights and FP8 metadata only).",
            )
    layers: list[Layer] = []
    kept: dict[str, str] = {}
    for module, payload in payloads.items():
        prefix = f"{module}." if module else ""
        try:
            gemms = unpack(payload).num_gemms
        except FP8StateError as err:
            raise ExportError(f"{prefix}_extra_state", err.found, err.expected, err.fix) from None
        if module in exclude:
            kept[module] = "excluded"
        elif gemms == 1 and f"{prefix}weight" in tensors:
            w = tensors[f"{prefix}weight"]
            layers.append(_layer(module, module, f"{prefix}weight", None, w, payload, 0))
        elif gemms == 2 and all(f"{prefix}{w}" in tensors for w, _, _ in _MLP):
            for gemm, (weight, bias, short) in enumerate(_MLP):
                bias_key = f"{prefix}{bias}" if f"{prefix}{bias}" in tensors else None
                layers.append(
                    _layer(
                        f"{prefix}{short}",
                        module,
                        f"{prefix}{weight}",
                        bias_key,
                        tensors[f"{prefix}{weight}"],
                        payload,
                        gemm,
                    )
                )
        else:
            kept[module] = f"{gemms} GEMMs and no weight key this export knows"
    return Plan(tensors, layers, kept, set(kept))
