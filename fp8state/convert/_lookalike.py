"""Modules that look like matmul layers but are of no type :func:`fp8state.convert_model` knows.

A model may hold its GEMMs in its own classes (a hand-written linear layer, a package's copy of
GPT-2's ``Conv1D``, a TransformerEngine ``Linear``). convert_model cannot swap them: it cannot
tell what their ``forward`` does with the weight. Left unmentioned, such a model would train
mostly in high precision while looking converted, so these modules are listed in the report
(``action="unrecognized"``) and in the warning, each with what gave it away.
"""

from __future__ import annotations

from torch import nn

from fp8state.mixin import FP8StateMixin

__all__ = ["lookalike_reason"]


def _evidence(module: nn.Module) -> list[str]:
    """What about ``module`` says "linear layer" (empty when nothing does)."""
    weight = module._parameters.get("weight")
    if weight is None or weight.dim() != 2:
        return []  # no 2-D weight of its own: a container, a convolution, a norm
    found = [f"a 2-D weight of its own {tuple(weight.shape)}"]
    features = [
        attr
        for attr in ("in_features", "out_features", "nf")
        if isinstance(getattr(module, attr, None), int)
    ]
    cls = type(module).__name__
    if features:
        found.append(f"{'/'.join(features)} attributes")
    if "Linear" in cls or cls == "Conv1D":
        found.append(f"the class name {cls}")
    return found if len(found) > 1 else []


def lookalike_reason(module: nn.Module, kind: str) -> str | None:
    """Why ``module`` (not a candidate type) looks like a GEMM convert_model leaves, or None.

    Args:
        module: A module that is no candidate of convert_model's rules.
        kind: Its type's name, as the report prints it.
    """
    if isinstance(module, FP8StateMixin):
        return None  # already FP8: fp8state's own module, or one built on the mixin
    evidence = _evidence(module)
    if not evidence:
        return None
    hint = (
        " (a TransformerEngine module: build the model with fp8state's modules and convert "
        "its checkpoint with `fp8state migrate`)"
        if kind.startswith("transformer_engine.")
        else ""
    )
    return (
        f"looks like a linear layer ({', '.join(evidence)}) but is a {kind}, a type "
        f"convert_model does not know, so it stays in high precision{hint}: replace it with "
        f"torch.nn.Linear, or write an FP8 module on fp8state.functional.fp8_linear, or "
        f"exclude it with module_filter_fn"
    )
