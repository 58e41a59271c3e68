"""Load a state dict into a model only after every key, shape and FP8 extra state checked out.

``nn.Module.load_state_dict`` copies module by module and raises at the end, so a bad checkpoint
leaves a half-loaded model behind, and its FP8 errors stop at the first module. Here everything
is checked first and reported together; the model is touched only when nothing is wrong.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fp8state._payload_checks import layout_problem
from fp8state.checkpoint._entries import Entry, KeyResolver, model_entries, walk_modules
from fp8state.checkpoint._problems import (
    keys_of,
    missing_fp8_metadata,
    missing_key,
    no_fp8_metadata,
    summarize,
)
from fp8state.errors import CheckpointError, FP8StateError, StateDictError
from fp8state.mixin import FP8StateMixin
from fp8state.schema import is_extra_state_key

__all__ = ["load_state_dict", "validate_state_dict"]


def _is_dtensor(value: object) -> bool:
    return isinstance(value, DTensor)


def _unexpected(key: str) -> CheckpointError:
    if is_extra_state_key(key):
        # Typically an fp8state checkpoint loaded into the plain nn.Linear model. strict=False
        # would load it, and would also hide every genuinely missing or misspelled weight
        # (docs/faq.md), so the fix is the interop guide's export, not strict=False.
        return CheckpointError(
            key,
            "an _extra_state that no module of the model takes (FP8 metadata, from an fp8state "
            "or TransformerEngine checkpoint)",
            "only the model's keys (strict=True)",
            "To load an FP8 checkpoint into a plain PyTorch model, load it into the FP8 model "
            "(fp8state.convert_model of this one) and export that with "
            "fp8state.checkpoint.to_plain_state_dict or save_safetensors: see docs/interop.md.",
        )
    return CheckpointError(
        key,
        "a key the model does not have",
        "only the model's keys (strict=True)",
        "Check that the model is built like the one that saved the checkpoint, or pass "
        "strict=False to ignore extra keys.",
    )


def _unusable(value: torch.Tensor) -> str | None:
    """What makes ``value`` impossible to copy into a dense tensor exactly, or None.

    ``Tensor.copy_`` raises for these only while ``load_state_dict`` runs, after other
    modules were already loaded: they are refused before anything changes.
    """
    if type(value) not in (torch.Tensor, nn.Parameter) and not _is_dtensor(value):
        return f"a {type(value).__name__} (a tensor subclass)"
    return layout_problem(value)  # a meta tensor: _check_tensor says why, in its own words


def _bad_kind(key: str, found: str) -> CheckpointError:
    return CheckpointError(
        key,
        found,
        "a dense (strided) torch.Tensor",
        "Convert it first (.to_dense(), .dequantize()); nothing was loaded.",
    )


def _check_tensor(entry: Entry, value: Any, assign: bool) -> tuple[Any, CheckpointError | None]:
    """Check a parameter's or buffer's value; return it (DTensor-ized if needed) or a problem."""
    live = entry.tensor()
    assert live is not None  # params and buffers always have a tensor
    if not isinstance(value, torch.Tensor):
        return value, CheckpointError(
            entry.key,
            f"a {type(value).__name__}",
            "a torch.Tensor",
            "The checkpoint is corrupt or not a state dict of this model.",
        )
    kind = _unusable(value)
    if kind is not None and not (live.is_quantized and value.is_quantized):
        return value, _bad_kind(entry.key, kind)
    if value.is_complex() and not live.is_complex():
        return value, CheckpointError(
            entry.key,
            f"a complex tensor ({value.dtype})",
            f"a real one, like the model's {live.dtype}",
            "Copying would drop the imaginary part; nothing was loaded.",
        )
    if nn.parameter.is_lazy(live):
        return value, None  # a lazy module takes the checkpoint's shape, as in PyTorch
    if tuple(value.shape) != tuple(live.shape):
        return value, CheckpointError(
            entry.key,
            f"shape {tuple(value.shape)}",
            f"shape {tuple(live.shape)} (the model's)",
            "Build the model with the configuration that saved the checkpoint.",
        )
    if value.device.type == "meta":
        return value, CheckpointError(
            entry.key,
            "a tensor on the meta device (it holds no data)",
            "a tensor with data",
            "Load the checkpoint file itself, not a state_dict() of a model built on 'meta'.",
        )
    if live.device.type == "meta" and not assign:
        return value, CheckpointError(
            entry.key,
            "a model tensor on the meta device (copying into it is a no-op)",
            "a materialized model",
            "Call model.to_empty(device=...) before loading, or pass assign=True.",
        )
    if isinstance(live, DTensor) and not _is_dtensor(value):
        # A full tensor for a sharded parameter (e.g. a consolidated file loaded on every
        # rank): each rank keeps its own shard, without communication (src_data_rank=None).
        local = value.to(live.to_local().device)
        return distribute_tensor(local, live.device_mesh, live.placements, src_data_rank=None), None
    if _is_dtensor(value) and not _is_dtensor(live):
        return value, CheckpointError(
            entry.key,
            "a DTensor (a sharded state dict)",
            "a plain tensor, like the model's",
            "Load a sharded checkpoint with fp8state.checkpoint.dcp_load, or call "
            "full_tensor() on its values first.",
        )
    return value, None


def _check_extra(entry: Entry, value: Any) -> tuple[Any, CheckpointError | FP8StateError | None]:
    """Validate an FP8 module's payload; return it as it will be loaded, or a problem.

    A mapping payload (schema 1) is read once, into a plain dict, and that dict is what
    validation sees and the module loads: a mapping answering differently on a second read
    cannot get other data past the check.
    """
    if not isinstance(entry.module, FP8StateMixin):
        return value, None  # another library's extra state: its own set_extra_state judges it
    if isinstance(value, Mapping):
        value = dict(value.items())
    tensors = [value] if isinstance(value, torch.Tensor) else []
    if isinstance(value, dict):
        tensors = [v for v in value.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        kind = _unusable(tensor)
        if kind is not None:
            return value, _bad_kind(entry.key, kind)
    try:
        entry.module._fp8_validate(value)
    except FP8StateError as err:
        return value, err.under(entry.key)
    return value, None


def validate_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    assign: bool = False,
) -> tuple[OrderedDict[str, Any], list[FP8StateError]]:
    """Check ``state_dict`` against ``model`` without changing either.

    Keys may be spelled as ``model.state_dict()`` does or as ``get_model_state_dict(model)``
    does (without DDP's ``module.`` and similar wrapper segments).

    Args:
        model: The model to load into.
        state_dict: A flat state dict (``torch.load`` of a ``torch.save(model.state_dict())``
            file, or what DCP filled in).
        strict: Report missing and unexpected keys, as ``load_state_dict(strict=True)`` does.
            The FP8 modules' missing ``_extra_state`` keys are one problem when the state
            dict has no ``_extra_state`` key at all (a checkpoint without FP8 metadata).
        assign: The ``assign`` that will be passed to ``load_state_dict`` (a model still on
            ``meta`` is fine with ``assign=True``).

    Returns:
        The state dict keyed as ``model.state_dict()`` keys it (full tensors for sharded
        parameters turned into DTensors) and the list of problems, empty when it fits.

    Example:
        >>> import torch, fp8state
        >>> from fp8state.checkpoint import validate_state_dict
        >>> model = torch.nn.Sequential(fp8state.Linear(16, 16))
        >>> sd = model.state_dict()
        >>> sd["0.weight"] = torch.zeros(3, 3)
        >>> _, problems = validate_state_dict(model, sd)
        >>> [(p.key, p.found) for p in problems]
        [('0.weight', 'shape (3, 3)')]
    """
    resolver = KeyResolver(model_entries(model))
    out: OrderedDict[str, Any] = OrderedDict()
    problems: list[FP8StateError] = []
    for key, value in state_dict.items():
        entry = resolver.resolve(key) if isinstance(key, str) else None
        if entry is None:
            if strict:
                problems.append(_unexpected(str(key)))
            out[key] = value
            continue
        if entry.key in out:
            problems.append(
                CheckpointError(
                    key,
                    f"a second value for {entry.key!r}",
                    "each key once (model spelling or canonical spelling, not both)",
                    "Remove one of the duplicate keys.",
                )
            )
            continue
        if entry.kind == "extra":
            value, problem = _check_extra(entry, value)
        else:
            value, problem = _check_tensor(entry, value, assign)
        if problem is not None:
            problems.append(problem)
        out[entry.key] = value
    if strict:
        problems += _missing_problems(resolver.entries, out, state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = _translate_metadata(model, metadata)  # type: ignore[attr-defined]
    return out, problems


def _missing_problems(
    entries: list[Entry], found: Mapping[str, Any], state_dict: Mapping[str, Any]
) -> list[FP8StateError]:
    """One problem per missing weight; FP8 metadata missing altogether is one problem."""
    missing = [e for e in entries if e.key not in found]
    fp8 = [e.key for e in missing if e.kind == "extra" and isinstance(e.module, FP8StateMixin)]
    problems: list[FP8StateError] = [missing_key(e.key) for e in missing if e.key not in fp8]
    if fp8 and not any(is_extra_state_key(k) for k in state_dict):
        problems.append(no_fp8_metadata(fp8))  # a plain checkpoint: say so once
    else:
        problems += [missing_fp8_metadata(key) for key in fp8]
    return problems


def _translate_metadata(model: nn.Module, metadata: Mapping[str, Any]) -> Any:
    """Re-key ``state_dict._metadata`` (per-module versions) to the model's module names."""
    names: dict[str, str] = {}
    for prefix, canonical, _ in walk_modules(model, "", ""):
        names.setdefault(canonical.rstrip("."), prefix.rstrip("."))
        names[prefix.rstrip(".")] = prefix.rstrip(".")
    out = OrderedDict()
    for key, value in metadata.items():
        out[names.get(key, key)] = value
    return out


def load_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any],
    strict: bool = True,
    *,
    assign: bool = False,
) -> Any:
    """Validate all of ``state_dict`` against ``model``, then load it.

    1. Every FP8 module's extra state is validated (schema, GEMM count, values), every
       parameter and buffer checked for presence (``strict``), type and shape.
    2. If anything is wrong, :class:`StateDictError` lists every problem (module names and
       what is wrong) and the model is unchanged. A state dict with no ``_extra_state`` key
       at all, for a model with FP8 modules, is a checkpoint without FP8 metadata: one
       problem says so and points at :func:`~fp8state.checkpoint.load_plain_state_dict`
       (missing and unexpected weights are still listed one by one).
    3. Otherwise ``model.load_state_dict`` runs; FP8 metadata lands on each module's own
       device, whatever device the state dict's tensors are on.

    Args:
        model: The model, plain or wrapped (DDP, FSDP2 ``fully_shard``, ``torch.compile``).
        state_dict: Flat state dict; keys as ``model.state_dict()`` or as
            ``get_model_state_dict(model)`` spells them. A full (unsharded) state dict also
            loads into an FSDP2 model: each rank keeps its shard.
        strict: As in ``nn.Module.load_state_dict``.
        assign: As in ``nn.Module.load_state_dict``.

    Returns:
        ``load_state_dict``'s named tuple of missing and unexpected keys.

    Raises:
        StateDictError: (a :class:`~fp8state.errors.CheckpointError`) listing every problem.

    Example:
        >>> import torch, fp8state
        >>> from fp8state.checkpoint import load_state_dict
        >>> class One(fp8state.FP8StateMixin):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.ones(2, 2))
        ...         self.init_fp8_meta(num_gemms=1, history_rows=4)
        >>> model = torch.nn.Sequential(One(), One())
        >>> sd = model.state_dict()
        >>> fp8state.schema.as_mapping(sd["0._extra_state"])["fwd.scale"][0] = -1.0  # in place
        >>> del sd["1.weight"]
        >>> try:
        ...     load_state_dict(model, sd)
        ... except fp8state.errors.CheckpointError as err:
        ...     print([p.key for p in err.problems])
        ["0._extra_state['fwd.scale']", '1.weight']
    """
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            "state_dict",
            f"a {type(state_dict).__name__}",
            "a mapping of keys to tensors",
            "Pass what fp8state.checkpoint.load (or torch.load) returned for a state dict.",
        )
    translated, problems = validate_state_dict(model, state_dict, strict=strict, assign=assign)
    if problems:
        raise StateDictError(
            keys_of(problems),
            summarize(problems),
            f"a state dict that fits {type(model).__name__} in every key",
            "Nothing was loaded; the model is unchanged. Fix the keys listed above.",
            problems,
        )
    return model.load_state_dict(translated, strict=strict, assign=assign)
