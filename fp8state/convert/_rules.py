"""Which ``torch.nn`` modules :func:`fp8state.convert_model` swaps, and why it leaves the others.

The rule is an exact type check: ``type(module) is nn.Linear`` (or ``nn.LayerNorm``,
``nn.RMSNorm``). A subclass may compute something else with the same parameters (a LoRA layer's
own ``forward``, a ``torch.nn.utils.parametrize`` class, an FSDP2 class), or its owner may use
its weight without calling it at all (``nn.MultiheadAttention`` passes ``out_proj.weight``, a
``NonDynamicallyQuantizableLinear``, to ``F.multi_head_attention_forward``). Swapping such a
module would change what the model computes, or add FP8 metadata that never updates, so it is
never swapped; the report says so.

An instance of an exact type is still left alone, with a reason, when the swap cannot keep what
it does: hooks or an instance-level ``forward`` (accelerate's dispatch hooks) would be dropped,
sharded (DTensor) weights would lose their sharding, and shapes ``torch._scaled_mm`` cannot
take would make every FP8 GEMM fall back to the slow emulation.

Hugging Face's ``Conv1D`` (``transformers.pytorch_utils.Conv1D``, GPT-2's matmuls: a linear
layer with its weight stored ``(in, out)``) is swapped the same way, for
``fp8state.Conv1D``. It is recognized by its class's name and module and by its ``nf`` and
``weight`` attributes, without importing ``transformers``, which stays optional.
"""

from __future__ import annotations

import sys

from torch import nn

from fp8state.backends import _SCALED_MM_ALIGN

__all__ = [
    "SWAPPABLE",
    "HF_CONV1D",
    "FP8_GEMM_DTYPES",
    "is_candidate",
    "is_hf_conv1d",
    "target_name",
    "is_swappable_type",
    "type_name",
    "subclass_reason",
    "module_problems",
    "pair_problem",
]

#: Exact types convert_model swaps, and what each becomes.
SWAPPABLE: dict[type[nn.Module], str] = {
    nn.Linear: "fp8state.Linear",
    nn.LayerNorm: "fp8state.LayerNorm",
    nn.RMSNorm: "fp8state.RMSNorm",
}

#: Hugging Face's ``Conv1D``, as (module, class name), and what it becomes.
HF_CONV1D = ("transformers.pytorch_utils", "Conv1D")
HF_CONV1D_TARGET = "fp8state.Conv1D"

#: Parameter dtypes whose GEMM outputs ``torch._scaled_mm`` produces.
FP8_GEMM_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")

# Per-module hook tables of nn.Module; a swap would silently drop every entry in them.
_HOOK_TABLES = (
    ("_forward_pre_hooks", "forward pre-hooks"),
    ("_forward_hooks", "forward hooks"),
    ("_backward_pre_hooks", "backward pre-hooks"),
    ("_backward_hooks", "backward hooks"),
    ("_state_dict_pre_hooks", "state_dict pre-hooks"),
    ("_state_dict_hooks", "state_dict hooks"),
    ("_load_state_dict_pre_hooks", "load_state_dict pre-hooks"),
    ("_load_state_dict_post_hooks", "load_state_dict post-hooks"),
)


def _is_hf_conv1d_class(cls: type) -> bool:
    return (cls.__module__, cls.__name__) == HF_CONV1D


def is_hf_conv1d(module: nn.Module) -> bool:
    """True when ``module`` is exactly Hugging Face's ``Conv1D`` (not a subclass)."""
    return _is_hf_conv1d_class(type(module))


def _derives_from_hf_conv1d(module: nn.Module) -> bool:
    return any(_is_hf_conv1d_class(cls) for cls in type(module).__mro__)


def is_candidate(module: nn.Module) -> bool:
    """True for the swappable types (Hugging Face's ``Conv1D`` included) and subclasses."""
    return isinstance(module, tuple(SWAPPABLE)) or _derives_from_hf_conv1d(module)


def is_swappable_type(module: nn.Module) -> bool:
    """True when ``module``'s type is exactly one convert_model swaps."""
    return type(module) in SWAPPABLE or is_hf_conv1d(module)


def target_name(module: nn.Module) -> str:
    """What a module of a swappable type becomes (``"fp8state.Linear"``)."""
    return HF_CONV1D_TARGET if is_hf_conv1d(module) else SWAPPABLE[type(module)]


def type_name(module: nn.Module) -> str:
    """``"torch.nn.Linear"`` for torch.nn's own classes, ``"package.module.Class"`` otherwise."""
    cls = type(module)
    if cls in SWAPPABLE or cls.__module__.startswith("torch.nn.modules."):
        return f"torch.nn.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def subclass_reason(module: nn.Module) -> str:
    """Why a subclass of a swappable type stays as it is."""
    bases = [f"torch.nn.{b.__name__}" for b in SWAPPABLE if isinstance(module, b)]
    base = bases[0] if bases else ".".join(HF_CONV1D)
    return (
        f"a subclass of {base}, never swapped: it may compute differently "
        f"(its own forward), or its owner may use its weight without calling it "
        f"(nn.MultiheadAttention's out_proj)"
    )


def _is_dtensor(value: object) -> bool:
    # Importing torch.distributed.tensor costs half a second; no DTensor exists before it is.
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    return dtensor_module is not None and isinstance(value, dtensor_module.DTensor)


def _instance_problems(module: nn.Module) -> list[str]:
    problems = []
    if "forward" in module.__dict__:
        problems.append(
            "its forward was replaced on the instance (accelerate's hooks do this); the swap "
            "would drop the replacement"
        )
    for attr, label in _HOOK_TABLES:
        table = getattr(module, attr, None)
        if table:
            problems.append(f"{len(table)} {label} registered on it; the swap would drop them")
    for name, param in module._parameters.items():
        if _is_dtensor(param):
            problems.append(
                f"its {name} is a DTensor (sharded); convert before fully_shard or "
                f"parallelize_module"
            )
        elif param is not None and not isinstance(param, nn.Parameter):
            problems.append(f"its {name} is a {type(param).__name__}, not an nn.Parameter")
    return problems


def _gemm_shape_problems(sizes: tuple[tuple[str, int], ...]) -> list[str]:
    """One reason for all the GEMM dimensions ``torch._scaled_mm`` cannot take (or none).

    ``sizes`` are ``(attribute, size)`` pairs, named as the module names them.
    """
    odd = [f"{name}={size}" for name, size in sizes if size == 0 or size % _SCALED_MM_ALIGN]
    if not odd:
        return []
    what = (
        f"{odd[0]} is not a positive multiple"
        if len(odd) == 1
        else f"{' and '.join(odd)} are not positive multiples"
    )
    return [
        f"{what} of {_SCALED_MM_ALIGN} (torch._scaled_mm needs both GEMM dimensions to be; "
        f"such a GEMM would run emulated, slower than high precision)"
    ]


def _dtype_problems(weight: object) -> list[str]:
    dtype = str(getattr(weight, "dtype", None))
    if dtype not in FP8_GEMM_DTYPES:
        return [f"dtype {dtype}: FP8 GEMMs produce {', '.join(FP8_GEMM_DTYPES)} outputs"]
    return []


def _linear_problems(linear: nn.Linear) -> list[str]:
    sizes = (("in_features", linear.in_features), ("out_features", linear.out_features))
    return _gemm_shape_problems(sizes) + _dtype_problems(linear.weight)


def _conv1d_problems(conv: nn.Module) -> list[str]:
    """Hugging Face's ``Conv1D``: ``nf`` outputs, a ``(nx, nf)`` weight, a ``(nf,)`` bias."""
    nf = getattr(conv, "nf", None)
    weight, bias = conv._parameters.get("weight"), conv._parameters.get("bias")
    if not isinstance(nf, int) or weight is None or weight.dim() != 2 or weight.shape[1] != nf:
        shape = None if weight is None else tuple(weight.shape)
        return [
            f"nf={nf!r} and a weight of shape {shape}: not the layout of transformers' Conv1D "
            f"(an int nf and a 2-D weight (nx, nf)), so what it computes is unknown"
        ]
    if bias is not None and tuple(bias.shape) != (nf,):
        return [f"a bias of shape {tuple(bias.shape)}: transformers' Conv1D adds one of ({nf},)"]
    sizes = (("nx", int(weight.shape[0])), ("nf", nf))
    return _gemm_shape_problems(sizes) + _dtype_problems(weight)


def _norm_problems(norm: nn.LayerNorm | nn.RMSNorm) -> list[str]:
    kind = type(norm).__name__
    problems = []
    if len(norm.normalized_shape) != 1:
        problems.append(
            f"normalized_shape={tuple(norm.normalized_shape)}: fp8state.{kind} normalizes "
            f"the last dimension only"
        )
    if norm.weight is None:
        problems.append(f"elementwise_affine=False: fp8state.{kind} always learns a weight")
    if isinstance(norm, nn.LayerNorm) and norm.weight is not None and norm.bias is None:
        problems.append("bias=False: fp8state.LayerNorm always learns a bias")
    if norm.eps is None:
        problems.append(
            "eps=None (an epsilon that depends on the input's dtype): fp8state.RMSNorm takes "
            "a number; build the nn.RMSNorm with an explicit eps"
        )
    return problems


def module_problems(module: nn.Module) -> list[str]:
    """Every reason ``module`` (of a swappable type) cannot be swapped; empty when it can."""
    problems = _instance_problems(module)
    if is_hf_conv1d(module):
        problems += _conv1d_problems(module)
    elif isinstance(module, nn.Linear):
        problems += _linear_problems(module)
    elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
        problems += _norm_problems(module)
    return problems


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) and is_swappable_type(module)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and is_swappable_type(module)


def pair_problem(
    norm: nn.Module, linear: nn.Module, norm_name: str = "", linear_name: str = ""
) -> str | None:
    """Why ``norm`` and ``linear`` cannot become one ``fp8state.LayerNormLinear``, or None.

    Both must be of a swappable type themselves (exactly ``nn.LayerNorm`` / ``nn.RMSNorm``,
    then exactly ``nn.Linear``); the norm must normalize exactly the linear layer's input
    features. The reason is one sentence naming both modules (by ``norm_name`` and
    ``linear_name`` when given) and their types.
    """
    norm_label = f"the norm {norm_name!r}" if norm_name else "the norm"
    linear_label = f"the linear layer {linear_name!r}" if linear_name else "the linear layer"
    if not (_is_norm(norm) and _is_linear(linear)):
        swapped = _is_linear(norm) and _is_norm(linear)
        return (
            f"{norm_label} is a {type_name(norm)} and {linear_label} is a "
            f"{type_name(linear)}"
            + (" (the two names look swapped: the norm comes first)" if swapped else "")
        )
    assert isinstance(norm, nn.LayerNorm | nn.RMSNorm) and isinstance(linear, nn.Linear)
    if tuple(norm.normalized_shape) != (linear.in_features,):
        return (
            f"{norm_label} ({type_name(norm)}) normalizes shape "
            f"{tuple(norm.normalized_shape)}, but {linear_label} ({type_name(linear)}) takes "
            f"{linear.in_features} features"
        )
    return None
