"""Plain-PyTorch state dicts: load weights without FP8 metadata, export weights without it.

- :func:`load_plain_state_dict` loads a state dict that has no ``_extra_state`` keys (a model
  trained without FP8, a Hugging Face checkpoint) into a model with fp8state modules: every FP8
  module starts with fresh metadata, and every real missing or unexpected weight is still
  reported (no ``strict=False`` needed); a tied weight that a safetensors file keeps under one
  name only is filled through its tie.
- :func:`to_plain_state_dict` exports the weights under the names of the ``nn.Linear``-based
  model (CPU, contiguous, no shared storage: ``safetensors.torch.save_file`` takes it as is),
  with the FP8 metadata dropped or returned beside it as a flat map of tensors.

The metadata map's format and the naming rules are in ``docs/interop.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal, overload

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fp8state.checkpoint._entries import Entry, KeyResolver, model_entries
from fp8state.checkpoint._plain_names import plain_keys
from fp8state.checkpoint._problems import keys_of, keys_of_strings, summarize
from fp8state.checkpoint._ties import tied_fills
from fp8state.checkpoint.validate import validate_state_dict
from fp8state.errors import CheckpointError, ConfigError, FP8StateError, StateDictError
from fp8state.mixin import FP8StateMixin
from fp8state.schema import EXTRA_STATE_KEY, as_mapping, default_payload

__all__ = ["load_plain_state_dict", "to_plain_state_dict"]

_METADATA_MARK = EXTRA_STATE_KEY + "."
_MODES = ("drop", "separate")


def _fp8_extras(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if e.kind == "extra" and isinstance(e.module, FP8StateMixin)]


# ---------------------------------------------------------------------------------- export
class _Exporter:
    """Turns state-dict values into safetensors-ready tensors, copying only what it must."""

    def __init__(self) -> None:
        self._storages: set[int] = set()

    def __call__(self, key: str, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                key,
                f"a {type(value).__name__} (another library's extra state?)",
                "a tensor",
                "A plain state dict holds tensors only; export that module's "
                "state separately, or remove the module before exporting.",
            )
        if isinstance(value, DTensor):
            raise CheckpointError(
                key,
                "a DTensor (a sharded parameter)",
                "a full tensor",
                "Export an unsharded copy of the model, or consolidate a DCP checkpoint "
                "first (fp8state consolidate DIR OUT.pt) and load it into one.",
            )
        if value.device.type == "meta":
            raise CheckpointError(
                key,
                "a tensor on the meta device (it holds no data)",
                "a tensor with data",
                "Materialize and load the model's weights before exporting them.",
            )
        tensor = value.detach().to("cpu").contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view into a larger block: keep only its own bytes
        storage = tensor.untyped_storage().data_ptr()
        if storage in self._storages:  # tied weights: safetensors refuses shared storage
            tensor = tensor.clone()
            storage = tensor.untyped_storage().data_ptr()
        self._storages.add(storage)
        return tensor


@overload
def to_plain_state_dict(
    model: nn.Module, *, fp8_metadata: Literal["drop"] = "drop"
) -> dict[str, torch.Tensor]: ...


@overload
def to_plain_state_dict(
    model: nn.Module, *, fp8_metadata: Literal["separate"]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...


def to_plain_state_dict(
    model: nn.Module, *, fp8_metadata: Literal["drop", "separate"] = "drop"
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's weights as plain PyTorch names them, ready for ``safetensors``.

    1. Keys are spelled as ``get_model_state_dict(model)`` spells them (no DDP ``module.``,
       no ``torch.compile`` ``_orig_mod.``), and the norm of a ``LayerNormLinear`` that
       :func:`fp8state.convert_model` fused gets its original name back
       (``ln.weight``, not ``fc.layer_norm_weight``). Other fp8state modules keep their
       names, which are ``nn.Linear``'s and ``nn.LayerNorm``'s (``weight``, ``bias``).
    2. No ``_extra_state`` key: the result loads into the ``nn.Linear``-based model with plain
       ``load_state_dict(strict=True)``.
    3. Values are CPU, contiguous and detached; no two share storage (tied weights are
       copied, once per key, as ``load_state_dict(strict=True)`` wants every key;
       :func:`~fp8state.checkpoint.save_safetensors` writes one name per shared tensor
       instead, as ``safetensors.torch.save_model`` does). Like ``state_dict()``, a value
       may share memory with a parameter that already was a contiguous CPU tensor.

    Args:
        model: The model (plain, or DDP / ``torch.compile`` wrapped; not sharded).
        fp8_metadata: ``"drop"``: weights only. ``"separate"``: also a flat
            ``dict[str, Tensor]`` of every FP8 module's metadata, keyed
            ``"<module name>._extra_state.<schema key>"`` (``docs/interop.md``), which
            :func:`load_plain_state_dict` takes back as ``fp8_metadata=``.

    Returns:
        The weights; or ``(weights, metadata)`` with ``fp8_metadata="separate"``.

    Raises:
        CheckpointError: a sharded (DTensor) or ``meta`` value, a non-tensor value, or a fused
            module whose recorded names no longer fit the model.
        ConfigError: ``fp8_metadata`` is not one of the modes (its type is named, never
            its value: a metadata map belongs to ``load_plain_state_dict``).

    Example:
        >>> import torch, fp8state
        >>> from fp8state.checkpoint import to_plain_state_dict
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32))
        >>> type(fp8state.convert_model(model, layernorm_linear=[("0", "1")])[1]).__name__
        'LayerNormLinear'
        >>> sorted(to_plain_state_dict(model))
        ['0.bias', '0.weight', '1.bias', '1.weight']
    """
    if not isinstance(fp8_metadata, str) or fp8_metadata not in _MODES:
        found = (
            repr(fp8_metadata)
            if isinstance(fp8_metadata, str)
            else (f"a {type(fp8_metadata).__name__}")
        )
        raise ConfigError(
            "to_plain_state_dict(fp8_metadata=)",
            found,
            f"one of {_MODES}",
            "Pass 'drop' for weights only, or 'separate' for (weights, metadata). A metadata "
            "map goes to load_plain_state_dict(..., fp8_metadata=) instead.",
        )
    entries = model_entries(model)
    names = plain_keys(entries)
    fp8_keys = {e.key for e in _fp8_extras(entries)}
    export = _Exporter()
    weights: dict[str, torch.Tensor] = {}
    metadata: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        plain = names.get(key, key)  # a key only a state_dict hook knows keeps its spelling
        if key not in fp8_keys:
            weights[plain] = export(plain, value)
        elif fp8_metadata == "separate":
            for field, tensor in as_mapping(value).items():
                flat = f"{plain}.{field}"
                metadata[flat] = export(flat, tensor)
    return (weights, metadata) if fp8_metadata == "separate" else weights


# ------------------------------------------------------------------------------------ load
def _extra_state_error(present: list[str], extras: list[Entry]) -> CheckpointError:
    missing = sorted({e.key for e in extras} - set(present))
    if missing:
        found = (
            f"_extra_state for {len(present)} of {len(extras)} FP8 modules "
            f"({keys_of_strings(present)}) and none for "
            f"{keys_of_strings(missing)}"
        )
        fix = (
            "Such a state dict mixes FP8 metadata and plain weights (edited, or assembled from "
            "two models). Drop every _extra_state key to start all FP8 modules fresh, or load "
            "a complete fp8state checkpoint with fp8state.checkpoint.load_state_dict."
        )
    else:
        found = "an _extra_state for every FP8 module (an fp8state or TransformerEngine checkpoint)"
        fix = (
            "Load it with fp8state.checkpoint.load_state_dict, which keeps the FP8 metadata; "
            "or drop the _extra_state keys to start every FP8 module fresh."
        )
    return CheckpointError(
        keys_of_strings(present),
        found,
        "a plain state dict: no _extra_state keys",
        fix,
    )


def _split_metadata(
    fp8_metadata: Mapping[str, Any], problems: list[FP8StateError]
) -> dict[str, dict[str, Any]]:
    """``{"<module name>._extra_state": payload}`` from the flat map; bad keys to ``problems``."""
    payloads: dict[str, dict[str, Any]] = {}
    for key, value in fp8_metadata.items():
        parts = split_metadata_key(key)
        if parts is None:
            problems.append(
                CheckpointError(
                    f"fp8_metadata[{key!r}]",
                    "a key without a '<module>._extra_state.' part",
                    "'<module name>._extra_state.<schema key>', as to_plain_state_dict writes",
                    "Pass the metadata map to_plain_state_dict(..., fp8_metadata='separate') "
                    "returned, unchanged.",
                )
            )
            continue
        module_key, field = parts
        payloads.setdefault(module_key, {})[field] = value
    return payloads


def split_metadata_key(key: object) -> tuple[str, str] | None:
    """``("<module>._extra_state", "<schema key>")`` of a flat FP8 metadata key, or None.

    None for anything else: not a string, no ``_extra_state.`` part, or one that is not a
    whole name (``"x_extra_state.scale"``).
    """
    if not isinstance(key, str):
        return None
    at = key.rfind(_METADATA_MARK)
    if at < 0 or (at > 0 and key[at - 1] != "."):
        return None
    return key[: at + len(EXTRA_STATE_KEY)], key[at + len(_METADATA_MARK) :]


def _with_metadata(
    combined: OrderedDict[str, Any],
    extras: list[Entry],
    fp8_metadata: Mapping[str, Any] | None,
    strict: bool,
    problems: list[FP8StateError],
) -> None:
    """Add every FP8 module's payload: the given one, else a fresh module's."""
    payloads = {} if fp8_metadata is None else _split_metadata(fp8_metadata, problems)
    for entry in extras:
        payload: Any = payloads.pop(entry.key, None) or payloads.pop(entry.canonical, None)
        if payload is None:
            if fp8_metadata is not None and strict:
                problems.append(
                    CheckpointError(
                        f"fp8_metadata[{entry.canonical}.*]",
                        "no metadata for this FP8 module",
                        "metadata for every FP8 module (strict=True)",
                        "Pass the whole map to_plain_state_dict(..., fp8_metadata='separate') "
                        "wrote for a model built like this one, or no fp8_metadata at all to "
                        "start every FP8 module fresh.",
                    )
                )
            assert isinstance(entry.module, FP8StateMixin)
            rows = entry.module.fp8_meta("fwd").amax_history.shape[0]
            payload = default_payload(entry.module.fp8_num_gemms, rows=rows)
        combined[entry.key] = payload
    # Metadata for modules the model lacks: validation reports them (strict) as unexpected.
    combined.update(payloads)


def load_plain_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any],
    strict: bool = True,
    *,
    assign: bool = False,
    fp8_metadata: Mapping[str, torch.Tensor] | None = None,
) -> Any:
    """Load weights without FP8 metadata; every FP8 module starts as a freshly built one.

    1. ``state_dict`` must have no FP8 ``_extra_state`` key: one with metadata for every FP8
       module is an fp8state checkpoint (use :func:`fp8state.checkpoint.load_state_dict`), one
       with metadata for some modules only is a mistake; both raise, naming the keys.
    2. Keys are spelled as plain PyTorch spells them (:func:`to_plain_state_dict`): the
       original norm's names for a ``LayerNormLinear`` that ``convert_model`` fused; the
       model's own spellings are accepted too.
    3. Tied weights: a key the state dict lacks is not missing when its parameter (or
       buffer) is the very same object as one under a key it holds (an output head tied
       to the embedding, of which safetensors files keep one name); it is filled through the
       tie.
    4. Every FP8 module gets the metadata of a freshly built module (zero histories, scales
       of 1, the default recipe), or its entry in ``fp8_metadata``. Fresh metadata for all of
       them, also with ``strict=False``: new weights change every layer's activations, so no
       old scale can be trusted.
    5. Everything is checked first (shapes, missing and unexpected weights, metadata); if
       anything is wrong, :class:`~fp8state.checkpoint.StateDictError` lists every problem
       and the model is unchanged.

    Args:
        model: The model with fp8state modules (plain or DDP / ``torch.compile`` wrapped).
        state_dict: Weights, e.g. ``torch.load(..., weights_only=True)`` of an
            ``nn.Linear``-based model's ``state_dict()``, or a Hugging Face safetensors file.
        strict: True: every missing and unexpected key is an error. False: they are returned.
            Positional or keyword, as in :func:`fp8state.checkpoint.load_state_dict`.
        assign: As in ``nn.Module.load_state_dict``.
        fp8_metadata: The flat map ``to_plain_state_dict(..., fp8_metadata="separate")``
            returned; with ``strict=True`` it must cover every FP8 module.

    Returns:
        ``load_state_dict``'s named tuple of missing and unexpected keys, spelled as in
        ``state_dict`` (empty with ``strict=True``).

    Raises:
        StateDictError: listing every problem; nothing was loaded.
        CheckpointError: ``state_dict`` holds FP8 ``_extra_state`` keys, or is not a mapping.
        ConfigError: ``fp8_metadata`` is neither a mapping nor None.

    Example:
        >>> import torch, fp8state
        >>> from fp8state.checkpoint import load_plain_state_dict
        >>> plain = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32))
        >>> model = fp8state.convert_model(
        ...     torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32)),
        ...     layernorm_linear=[("0", "1")])
        >>> load_plain_state_dict(model, plain.state_dict())
        <All keys matched successfully>
        >>> torch.equal(model[1].layer_norm_weight, plain[0].weight)
        True
    """
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            "state_dict",
            f"a {type(state_dict).__name__}",
            "a mapping of keys to tensors",
            "Pass a state dict (torch.load(..., weights_only=True) or safetensors' load_file).",
        )
    if fp8_metadata is not None and not isinstance(fp8_metadata, Mapping):
        found = f"a {type(fp8_metadata).__name__}" + (
            f" ({fp8_metadata!r}, a mode of to_plain_state_dict)"
            if isinstance(fp8_metadata, str) and fp8_metadata in _MODES
            else ""
        )
        raise ConfigError(
            "load_plain_state_dict(fp8_metadata=)",
            found,
            "a mapping of '<module>._extra_state.<schema key>' to tensors, or None",
            "Pass the map to_plain_state_dict(..., fp8_metadata='separate') returned (its "
            "second item), or None to start every FP8 module fresh.",
        )
    entries = model_entries(model)
    names = plain_keys(entries)
    extras = _fp8_extras(entries)
    extra_keys = {e.key for e in extras}
    resolver = KeyResolver(entries)
    present = [
        e.key
        for k in state_dict
        if isinstance(k, str) and (e := resolver.resolve(k)) is not None and e.key in extra_keys
    ]
    if present:
        raise _extra_state_error(present, extras)
    # The norm of a fused pair: the plain name goes to the fused module's key.
    fused = {names[e.key]: e.key for e in entries if names[e.key] != e.canonical}
    problems: list[FP8StateError] = []
    combined: OrderedDict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        target = fused.get(key, key) if isinstance(key, str) else key
        if target in combined:
            problems.append(
                CheckpointError(
                    key,
                    f"a second value for {target!r}",
                    "each weight once",
                    f"Keep either {key!r} or {target!r}.",
                )
            )
            continue
        combined[target] = value
    fills = tied_fills(resolver, combined)  # keys a safetensors file dropped for a tie
    for key, source in fills.items():
        combined[key] = combined[source]
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # per-module versions, which some _load_from_state_dict read
        combined._metadata = metadata  # type: ignore[attr-defined]
    _with_metadata(combined, extras, fp8_metadata, strict, problems)
    translated, found = validate_state_dict(model, combined, strict=strict, assign=assign)
    problems += [
        p if p.key not in names else type(p)(names[p.key], p.found, p.expected, p.fix)
        for p in found
        if p.key not in fills
    ]  # a tie repeats its source's problem
    if problems:
        raise StateDictError(
            keys_of(problems),
            summarize(problems),
            f"plain weights that fit {type(model).__name__} in every key",
            "Nothing was loaded; the model is unchanged. Fix the keys listed above.",
            problems,
        )
    result = model.load_state_dict(translated, strict=strict, assign=assign)
    return result._replace(missing_keys=[names.get(k, k) for k in result.missing_keys])
