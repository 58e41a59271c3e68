"""Export a model trained in FP8 as an FP8 inference checkpoint (compressed-tensors).

:func:`export_fp8` writes a Hugging Face style folder that serving stacks (vLLM, SGLang,
``transformers`` with ``compressed-tensors``) read as a per-tensor static FP8 model: each
converted linear layer's weight in ``float8_e4m3fn`` with its ``weight_scale`` (from the weight
itself) and ``input_scale`` (from the forward input's amax history, as the recipe computes it
in training), everything else in the training dtype. docs/export.md describes the files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fp8state._shown import shown
from fp8state.errors import ConfigError, ExportError
from fp8state.export._architecture import Architecture, architecture
from fp8state.export._compressed_tensors import (
    FORMAT_NAME,
    QUANT_METHOD,
    quantization_config,
    quantized_tensors,
)
from fp8state.export._folder import CONFIG_FILE, COPIED_FILES, check_target, write_folder
from fp8state.export._inspect import describe_export
from fp8state.export._layers import Plan, join, plan_from_model, plan_from_state_dict
from fp8state.export._scales import InputScaleRule
from fp8state.export._shards import DEFAULT_MAX_SHARD_BYTES, unreadable, weight_files

__all__ = [
    "export_fp8",
    "export_state_dict",
    "read_export",
    "describe_export",
    "architecture",
    "Architecture",
    "ExportReport",
    "FORMATS",
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "weight_files",
    "unreadable",
]

#: The formats :func:`export_fp8` writes.
FORMATS = ("compressed-tensors",)


@dataclass
class ExportReport:
    """What an export wrote.

    Attributes:
        out_dir: The folder.
        scales: Per converted layer, ``(weight_scale, input_scale)`` as written.
        ignored: Modules left in the training dtype, as listed in ``ignore``.
        kept: FP8 modules not converted, with the reason.
    """

    out_dir: str
    scales: dict[str, tuple[float, float]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ConfigError("format", repr(format), f"one of {FORMATS}", "Pass 'compressed-tensors'.")


def _check_shard_size(max_shard_bytes: int) -> None:
    if type(max_shard_bytes) is not int or max_shard_bytes < 1:
        raise ConfigError(
            "max_shard_bytes", repr(max_shard_bytes), "an int >= 1", "Pass a size in bytes."
        )


def _copied(copy_from: str | os.PathLike[str] | None) -> list[str]:
    if copy_from is None:
        return []
    folder = os.fspath(copy_from)
    return [
        os.path.join(folder, n) for n in COPIED_FILES if os.path.isfile(os.path.join(folder, n))
    ]


def _write(
    plan: Plan,
    out_dir: str,
    base_config: Mapping[str, Any],
    rule: InputScaleRule,
    copy_from: Iterable[str],
    overwrite: bool,
    max_shard_bytes: int,
) -> ExportReport:
    if not plan.layers:
        raise ExportError(
            out_dir,
            "no layer to convert"
            + (f" (not converted: {shown(sorted(plan.kept))})" if plan.kept else ""),
            "at least one fp8state Linear, LayerNormLinear or LayerNormMLP that ran in FP8",
            "Convert the model (fp8state.convert_model) and train or calibrate it in FP8.",
        )
    tensors = quantized_tensors(plan, rule)
    names = {layer.name for layer in plan.layers}
    # Every module left with a weight in the training dtype (embeddings, norms, layers not
    # converted): compressed-tensors matches "Linear" targets, and skips these.
    held = {k[: -len("weight")].rstrip(".") for k in tensors if k.split(".")[-1] == "weight"}
    ignored = sorted((held | plan.unconverted) - names)
    config = {**base_config, "quantization_config": quantization_config(ignored)}
    write_folder(out_dir, tensors, config, copy_from, overwrite, max_shard_bytes)
    scales = {
        n: (tensors[join(n, "weight_scale")].item(), tensors[join(n, "input_scale")].item())
        for n in sorted(names)
    }
    return ExportReport(out_dir, scales, ignored, dict(plan.kept))


def export_fp8(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    format: str = "compressed-tensors",
    config: Mapping[str, Any] | None = None,
    copy_from: str | os.PathLike[str] | None = None,
    window: int | None = None,
    percentile: float | None = None,
    exclude: Iterable[str] = (),
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportReport:
    """Write ``model`` as an FP8 inference checkpoint folder.

    Args:
        model: A model holding fp8state modules that ran in FP8 (trained or calibrated).
        out_dir: The folder to write; it must not exist unless ``overwrite``.
        format: ``"compressed-tensors"`` (per-tensor static FP8, ``float-quantized``).
        config: The model config written to ``config.json`` (a Hugging Face model's own
            ``model.config`` by default; none for other models: ``config.json`` then holds
            only the ``quantization_config``).
        copy_from: A folder whose tokenizer and generation files are copied in.
        window: Steps of amax history the input scale is taken from (the recipe's
            ``amax_history_len`` by default).
        percentile: Take the input amax as this percentile of the recorded amaxes in the
            window instead of the recipe's ``max`` or ``most_recent``.
        exclude: Module names to leave in the training dtype.
        overwrite: Replace an existing ``out_dir``.
        max_shard_bytes: Past this size (5 GB by default, Hugging Face's) the weights go
            into ``model-0000i-of-0000n.safetensors`` shards with an index.

    Returns:
        What was written, with every scale.

    Raises:
        ExportError: a module that never ran in FP8, a non-finite or zero scale, a weight
            shape FP8 GEMMs cannot take, an existing ``out_dir``; nothing is written.
        ConfigError: an unknown ``format``, ``window`` or ``percentile``.

    Example:
        >>> import tempfile, torch, fp8state
        >>> model = torch.nn.Sequential(fp8state.Linear(32, 32))
        >>> with fp8state.fp8_autocast():
        ...     _ = model(torch.randn(4, 32))
        >>> report = fp8state.export_fp8(model, tempfile.mkdtemp() + "/out")
        >>> sorted(report.scales), report.ignored
        (['0'], [])
    """
    _check_format(format)
    _check_shard_size(max_shard_bytes)
    rule = InputScaleRule(window, percentile)
    out = os.fspath(out_dir)
    check_target(out, overwrite)
    plan = plan_from_model(model, _names(exclude))
    base = getattr(model, "config", None) if config is None else config
    return _write(plan, out, _as_dict(base), rule, _copied(copy_from), overwrite, max_shard_bytes)


def _names(exclude: Iterable[str]) -> set[str]:
    if isinstance(exclude, str) or not all(isinstance(n, str) for n in exclude):
        raise ConfigError(
            "exclude", shown(exclude), "an iterable of module names", "Pass e.g. ['lm_head']."
        )
    return set(exclude)


def _as_dict(config: object) -> dict[str, Any]:
    """A config as plain data: a mapping, or an object with ``to_dict`` (``PretrainedConfig``)."""
    if config is None:
        return {}
    to_dict = getattr(config, "to_dict", None)
    data = to_dict() if callable(to_dict) else config
    if not isinstance(data, Mapping):
        raise ConfigError(
            "config", f"a {type(config).__name__}", "a mapping or a PretrainedConfig", ""
        )
    return dict(data)


def export_state_dict(
    state: Mapping[str, object],
    out_dir: str | os.PathLike[str],
    *,
    config: Mapping[str, Any],
    architecture: Architecture,
    copy_from: str | os.PathLike[str] | None = None,
    window: int | None = None,
    percentile: float | None = None,
    exclude: Iterable[str] = (),
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportReport:
    """:func:`export_fp8` of a flat state dict with ``<module>._extra_state`` entries.

    A state dict does not say which weights are ``nn.Linear``'s (``(out, in)``) and which are
    laid out otherwise (GPT-2's ``Conv1D`` stores ``(in, out)``), nor what a fused module's
    parts were called: the model's ``architecture`` says. A layer that is not one of its
    ``nn.Linear`` modules is refused rather than written transposed, and so is any tensor
    whose name the architecture does not have (a fused ``LayerNormLinear``'s
    ``layer_norm_weight``: export such models from Python, which knows the original names).

    Args:
        state: The state dict (weights and FP8 metadata).
        out_dir: The folder to write.
        config: The model config for ``config.json``.
        architecture: The model's ``nn.Linear`` names and state-dict keys
            (:func:`architecture` of its Hugging Face folder).
        copy_from: As in :func:`export_fp8`.
        window: As in :func:`export_fp8`.
        percentile: As in :func:`export_fp8`.
        exclude: As in :func:`export_fp8`.
        overwrite: As in :func:`export_fp8`.
        max_shard_bytes: As in :func:`export_fp8`.

    Raises:
        ExportError: as :func:`export_fp8`, and a layer that is not an ``nn.Linear`` of the
            architecture or a tensor it does not have.
    """
    _check_shard_size(max_shard_bytes)
    rule = InputScaleRule(window, percentile)
    out = os.fspath(out_dir)
    check_target(out, overwrite)
    plan = plan_from_state_dict(state, _names(exclude))
    strange = sorted(set(plan.tensors) - architecture.keys)
    if strange:
        raise ExportError(
            shown(strange),
            f"{len(strange)} tensor(s) the model's architecture does not have",
            "the architecture's own state-dict keys",
            "Export from Python with fp8state.export_fp8(model), which knows fused modules' "
            "original names; or strip wrapper prefixes (DDP's module.) from the keys.",
        )
    plan.unconverted |= architecture.linears - {layer.name for layer in plan.layers}
    for layer in plan.layers:
        if layer.name not in architecture.linears:
            raise ExportError(
                layer.source,
                f"{layer.name} is not an nn.Linear of the model's architecture",
                "FP8 layers that are nn.Linear modules where the model is loaded",
                "Export from Python with the model (fp8state.export_fp8), which knows each "
                "module's layout, or exclude the module.",
            )
    return _write(plan, out, _as_dict(config), rule, _copied(copy_from), overwrite, max_shard_bytes)


def read_export(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``quantization_config`` of an exported folder, or None if ``folder`` is not one."""
    path = os.path.join(os.fspath(folder), CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as file:
            quant = json.load(file).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    ok = isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD
    return quant if ok and quant.get("format") == FORMAT_NAME else None
