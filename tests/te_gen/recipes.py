"""TE's recipe classes as each era pickled them (te_formats.md, section 5), without TE.

Plain classes whose instances pickle like pydantic-2 dataclasses (``NEWOBJ`` + ``BUILD`` of the
field dict) under TE's names. Only v2.x pickles recipes; earlier eras never store one.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from te_gen.tepickle import te_name

RECIPE = "transformer_engine.common.recipe"


@te_name(RECIPE, "_FormatHelper")
class FormatHelper(NamedTuple):
    max_fwd: int
    max_bwd: int


@te_name(RECIPE, "Format")
class Format(enum.Enum):
    E4M3 = FormatHelper(448, 448)
    E5M2 = FormatHelper(57344, 57344)
    HYBRID = FormatHelper(448, 57344)
    E2M1 = FormatHelper(6, 6)


class _Recipe:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _recipe_class(name: str) -> type[_Recipe]:
    return te_name(RECIPE, name)(type(name, (_Recipe,), {}))


DelayedScaling = _recipe_class("DelayedScaling")
Float8CurrentScaling = _recipe_class("Float8CurrentScaling")
MXFP8BlockScaling = _recipe_class("MXFP8BlockScaling")
Float8BlockScaling = _recipe_class("Float8BlockScaling")
NVFP4BlockScaling = _recipe_class("NVFP4BlockScaling")
CustomRecipe = _recipe_class("CustomRecipe")
MMParams = _recipe_class("MMParams")


def delayed_scaling(
    era: str, *, fmt: str = "HYBRID", margin: int = 0, length: int = 1024, algo: str = "max"
) -> _Recipe:
    """A ``DelayedScaling`` with the fields the era's TE tag declares."""
    fields: dict[str, Any] = {
        "margin": margin,
        "fp8_format": Format[fmt],
        "amax_history_len": length,
        "amax_compute_algo": algo,
        "scaling_factor_compute_algo": None,
        "reduce_amax": True,
        "fp8_dpa": False,
        "fp8_mha": False,
    }
    if era == "E10":
        fields["backward_override"] = None
        fields["_cached_repr"] = (
            f"recipe_type=DelayedScaling, margin={margin}, format={fmt}, "
            f"amax_history_len={length}, reduce_amax=True"
        )
    return DelayedScaling(**fields)


def stateless(kind: str) -> _Recipe:
    """One of the recipes TE stores no tensors for."""
    mm = MMParams(use_split_accumulator=True)
    if kind == "Float8CurrentScaling":
        return Float8CurrentScaling(
            fp8_format=Format.HYBRID,
            fp8_gemm_fprop=mm,
            fp8_gemm_dgrad=mm,
            fp8_gemm_wgrad=mm,
            fp8_dpa=False,
            fp8_mha=False,
            use_power_2_scales=False,
        )
    if kind == "Float8BlockScaling":
        return Float8BlockScaling(
            use_f32_scales=False,
            fp8_format=Format.E4M3,
            x_block_scaling_dim=1,
            w_block_scaling_dim=2,
            grad_block_scaling_dim=1,
            fp8_gemm_fprop=mm,
            fp8_gemm_dgrad=mm,
            fp8_gemm_wgrad=mm,
            fp8_dpa=False,
            fp8_mha=False,
        )
    if kind == "NVFP4BlockScaling":
        return NVFP4BlockScaling(
            disable_rht=False,
            disable_stochastic_rounding=False,
            disable_2d_quantization=False,
            fp4_format=Format.E2M1,
            fp8_format=Format.E4M3,
            fp8_dpa=False,
            fp8_mha=False,
        )
    return MXFP8BlockScaling(margin=0, fp8_format=Format.E4M3, fp8_dpa=False, fp8_mha=False)
