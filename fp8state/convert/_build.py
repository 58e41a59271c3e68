"""Build the fp8state module that replaces a ``torch.nn`` one, around the very same Parameters.

The new module is constructed on ``meta`` (no memory, no initialization work) and then takes
the original ``nn.Parameter`` objects, so an optimizer built before the conversion, tied
weights, ``requires_grad`` and the parameters' device and dtype all stay as they were. Its FP8
metadata is then made real on the weight's device through ``set_extra_state`` with the default
payload, the same values a freshly built module starts with (:func:`fp8state.schema.
default_payload`); a model on ``meta`` keeps ``meta`` metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from fp8state.convert._rules import is_hf_conv1d
from fp8state.mixin import FP8StateMixin
from fp8state.modules import LayerNorm, LayerNormLinear, Linear, RMSNorm
from fp8state.modules.conv1d import Conv1D
from fp8state.schema import default_payload

__all__ = ["FusedFrom", "FUSED_FROM_ATTR", "build_swap", "build_fused", "is_fused_pair"]

#: Attribute of a ``LayerNormLinear`` made by convert_model that records the original names.
FUSED_FROM_ATTR = "fp8_fused_from"


@dataclass(frozen=True)
class FusedFrom:
    """The modules a ``LayerNormLinear`` was fused from, by their names at conversion time.

    ``convert_model`` stores one as ``module.fp8_fused_from``; ``to_plain_state_dict`` and
    ``load_plain_state_dict`` use it to spell the fused module's norm parameters as the
    original norm's (``norm + ".weight"`` for ``layer_norm_weight``).

    Attributes:
        norm: Name of the original ``nn.LayerNorm`` / ``nn.RMSNorm`` (now an ``nn.Identity``).
        linear: Name of the original ``nn.Linear`` (where the ``LayerNormLinear`` now sits).
    """

    norm: str
    linear: str


def _materialize_fp8_metadata(module: FP8StateMixin, device: torch.device) -> None:
    """Give a module built on ``meta`` the default FP8 metadata on ``device``."""
    if device.type == "meta":
        return
    rows = module.fp8_meta("fwd").amax_history.shape[0]
    payload = default_payload(module.fp8_num_gemms, rows=rows, recipe=module.fp8_recipe)
    module.set_extra_state(payload.to(device))


def _take_linear_params(new: Linear | LayerNormLinear, linear: nn.Linear) -> None:
    new.weight = cast(nn.Parameter, linear.weight)
    if linear.bias is not None:  # else the new module was built with bias=False
        new.bias = cast(nn.Parameter, linear.bias)


def _linear(linear: nn.Linear) -> Linear:
    new = Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=linear.weight.dtype,
        device="meta",
    )
    _take_linear_params(new, linear)
    _materialize_fp8_metadata(new, linear.weight.device)
    return new


def _conv1d(conv: nn.Module) -> Conv1D:
    """Hugging Face's ``Conv1D`` (layout checked by the rules) as an ``fp8state.Conv1D``."""
    weight, bias = conv._parameters["weight"], conv._parameters.get("bias")
    assert weight is not None  # checked by _rules
    new = Conv1D(
        weight.shape[1],
        weight.shape[0],
        bias=bias is not None,
        params_dtype=weight.dtype,
        device="meta",
    )
    new.weight = cast(nn.Parameter, weight)
    if bias is not None:
        new.bias = cast(nn.Parameter, bias)
    _materialize_fp8_metadata(new, weight.device)
    return new


def _norm(norm: nn.LayerNorm | nn.RMSNorm) -> LayerNorm | RMSNorm:
    assert norm.weight is not None and norm.eps is not None  # checked by _convert_rules
    cls = LayerNorm if isinstance(norm, nn.LayerNorm) else RMSNorm
    new = cls(norm.normalized_shape[0], eps=norm.eps, params_dtype=norm.weight.dtype, device="meta")
    new.weight = norm.weight
    if isinstance(norm, nn.LayerNorm):
        new.bias = norm.bias
    return new


def build_swap(module: nn.Module) -> nn.Module:
    """The fp8state counterpart of ``module`` (an exact swappable type), sharing its Parameters.

    Raises:
        TypeError: ``module`` is not of a type convert_model swaps (an internal error: the
            planner only passes swappable modules).
    """
    new: nn.Module
    if type(module) is nn.Linear:
        new = _linear(module)
    elif is_hf_conv1d(module):
        new = _conv1d(module)
    elif type(module) in (nn.LayerNorm, nn.RMSNorm):
        assert isinstance(module, nn.LayerNorm | nn.RMSNorm)
        new = _norm(module)
    else:
        raise TypeError(f"no fp8state counterpart for {type(module).__qualname__}")
    new.train(module.training)
    return new


def build_fused(
    norm: nn.LayerNorm | nn.RMSNorm, linear: nn.Linear, names: FusedFrom
) -> LayerNormLinear:
    """A ``LayerNormLinear`` computing ``linear(norm(x))`` with both modules' Parameters."""
    assert norm.weight is not None and norm.eps is not None  # checked by _convert_rules
    normalization = "LayerNorm" if isinstance(norm, nn.LayerNorm) else "RMSNorm"
    new = LayerNormLinear(
        linear.in_features,
        linear.out_features,
        eps=norm.eps,
        bias=linear.bias is not None,
        normalization=normalization,
        params_dtype=linear.weight.dtype,
        device="meta",
    )
    new.layer_norm_weight = norm.weight
    if isinstance(norm, nn.LayerNorm):
        new.layer_norm_bias = norm.bias
    _take_linear_params(new, linear)
    _materialize_fp8_metadata(new, linear.weight.device)
    setattr(new, FUSED_FROM_ATTR, names)
    new.train(linear.training)
    return new


def is_fused_pair(norm: nn.Module, linear: nn.Module, names: FusedFrom) -> bool:
    """True when ``build_fused`` made this pair already (a second conversion).

    The norm's place then holds an ``nn.Identity`` and the linear's a ``LayerNormLinear``
    fused from exactly these names.
    """
    return (
        type(norm) is nn.Identity
        and type(linear) is LayerNormLinear
        and getattr(linear, FUSED_FROM_ATTR, None) == names
    )
