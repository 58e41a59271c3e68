"""Save and load models of fp8state modules with ``torch.distributed.checkpoint`` (DCP).

FP8 metadata is not sharded: every rank holds a full copy of each module's ``_extra_state``
(plain tensors, also under FSDP2), which DCP stores once. :func:`dcp_save` first checks that
the ranks agree (:mod:`fp8state.checkpoint.replicated`). :func:`dcp_load` needs no custom
planner: a checkpoint saved on N ranks loads on M ranks into a plain, DDP or FSDP2 model.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from fp8state.checkpoint._dcp_errors import dcp_failure
from fp8state.checkpoint._metadata_checks import check_coverage, check_fields
from fp8state.checkpoint._problems import (
    keys_of,
    missing_fp8_metadata,
    summarize,
)
from fp8state.checkpoint.dcp_untrusted import AllowListReader
from fp8state.checkpoint.replicated import check_fp8_metadata_replicated
from fp8state.checkpoint.validate import load_state_dict, validate_state_dict
from fp8state.errors import (
    CheckpointError,
    FP8StateError,
    StateDictError,
    UnsafeCheckpointError,
)
from fp8state.schema import is_payload

__all__ = ["dcp_save", "dcp_load"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _dcp_call(where: str, action: str) -> Iterator[None]:
    """Run a DCP call: quiet when single-process, its failures as CheckpointError."""
    with warnings.catch_warnings():
        if not _distributed():
            # DCP warns it "assumes a single process" even when told so with no_dist=True.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except FP8StateError:
            raise
        except (Exception, CheckpointException) as err:
            # CheckpointException is a BaseException: `except Exception` in user code would
            # not see it, so it is turned into the error this library documents, naming the
            # error it wraps (its own text is a traceback per rank).
            cause = dcp_failure(err)
            raise CheckpointError(
                where,
                f"DCP failed to {action} ({type(cause).__name__}: {cause})",
                f"DCP to {action} the checkpoint",
                "Check the folder is complete and readable (or writable) on every rank.",
            ) from err


def dcp_save(
    model: nn.Module,
    checkpoint_id: str | os.PathLike[str],
    *,
    process_group: Any = None,
    key: str | None = None,
    check_replicated: bool = True,
    storage_writer: Any = None,
) -> Metadata:
    """Save ``model`` with DCP, after checking its FP8 metadata agrees across ranks.

    Collective: every rank of ``process_group`` calls it. The state dict is
    ``get_model_state_dict(model)``: canonical keys (no DDP ``module.`` prefix), DTensor
    shards for FSDP2 parameters, and each FP8 module's extra state as plain CPU tensors.

    Args:
        model: Plain, DDP or FSDP2 (``fully_shard``) model.
        checkpoint_id: The folder to write.
        process_group: DCP's process group (None: the default group).
        key: Store the model under this key (``{"model": ...}``) instead of at the top level.
        check_replicated: Run :func:`check_fp8_metadata_replicated` first (one small
            collective over ``process_group``).
        storage_writer: Passed to ``dcp.save`` (default: a ``FileSystemWriter``).

    Returns:
        DCP's metadata of the written checkpoint.

    Raises:
        DistributedStateError: ranks disagree on some module's FP8 metadata; nothing was
            written.
        CheckpointError: DCP failed to write.

    Example:
        >>> import tempfile, torch, fp8state
        >>> from fp8state.checkpoint import dcp_load, dcp_save
        >>> class One(fp8state.FP8StateMixin):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.randn(2, 2))
        ...         self.init_fp8_meta(num_gemms=1, history_rows=4)
        >>> folder = tempfile.mkdtemp()
        >>> saved = One()
        >>> _ = dcp_save(saved, folder)
        >>> loaded = One()
        >>> dcp_load(loaded, folder)
        <All keys matched successfully>
        >>> torch.equal(loaded.weight, saved.weight)
        True
    """
    sd = get_model_state_dict(model)
    if check_replicated:
        check_fp8_metadata_replicated(sd, group=process_group)
    state = sd if key is None else {key: sd}
    with _dcp_call(os.fspath(checkpoint_id), "write"):
        return dcp.save(
            state,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            process_group=process_group,
            no_dist=not _distributed(),
        )


@dataclass
class _Plan:
    """The model's state dict matched against the checkpoint's metadata."""

    extra: dict[str, Any] = field(default_factory=dict)  # FP8 payload templates
    rest: dict[str, Any] = field(default_factory=dict)  # parameters, buffers, other state
    mismatched: list[FP8StateError] = field(default_factory=list)
    missing: list[FP8StateError] = field(default_factory=list)


def _stored(md: Metadata, key: str | None) -> dict[str, dict[tuple, Any]]:
    """``{top-level key: {sub-path: storage metadata}}`` of what the checkpoint holds."""
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    depth = 0 if key is None else 1
    stored: dict[str, dict[tuple, Any]] = {}
    for flat, item in md.state_dict_metadata.items():
        # The default planner records each flat key's path into the nested dict.
        path = tuple(planner_data.get(flat, (flat,)))
        if key is not None and (not path or path[0] != key):
            continue
        if len(path) > depth:
            stored.setdefault(str(path[depth]), {})[path[depth + 1 :]] = item
    return stored


def _plan(sd: dict[str, Any], md: Metadata, key: str | None, trusted: bool) -> _Plan:
    stored = _stored(md, key)
    plan = _Plan()
    for name, value in sd.items():
        items = stored.get(name)
        if items is None and is_payload(value):
            plan.missing.append(
                missing_fp8_metadata(
                    name, "checkpoint", reader="fp8state.checkpoint.load_dcp_state_dict"
                )
            )
        elif items is None:
            plan.missing.append(
                CheckpointError(
                    name,
                    "no such key in the checkpoint",
                    "every key of the model (strict=True)",
                    "Load a checkpoint of this model, or pass strict=False.",
                )
            )
        elif is_payload(value):
            # Shaped like the checkpoint's payload, not the fresh model's: a history saved
            # with other row counts (or an older schema) loads, and the module adapts it.
            whole = items.get(())
            if isinstance(whole, TensorStorageMetadata):  # schema 2: one tensor
                plan.extra[name] = torch.empty(whole.size, dtype=whole.properties.dtype)
            else:  # schema 1: a dict of tensors, which DCP stored key by key
                plan.extra[name] = {
                    str(sub[0]): torch.empty(item.size, dtype=item.properties.dtype)
                    for sub, item in items.items()
                    if len(sub) == 1 and isinstance(item, TensorStorageMetadata)
                }
        elif isinstance(value, torch.Tensor):
            item = items.get(())
            if not isinstance(item, TensorStorageMetadata):
                plan.mismatched.append(
                    CheckpointError(
                        name,
                        "a non-tensor item in the checkpoint",
                        "a tensor",
                        "The checkpoint was saved from another model.",
                    )
                )
            elif tuple(item.size) != tuple(value.shape):
                plan.mismatched.append(
                    CheckpointError(
                        name,
                        f"shape {tuple(item.size)} in the checkpoint",
                        f"shape {tuple(value.shape)} (the model's)",
                        "Build the model with the configuration that saved the checkpoint.",
                    )
                )
            else:
                plan.rest[name] = value
        elif not trusted and any(
            not isinstance(item, TensorStorageMetadata) for item in items.values()
        ):
            # DCP's planner would unpickle the item with plain pickle.
            plan.mismatched.append(
                UnsafeCheckpointError(
                    name,
                    "a non-tensor item, which DCP reads with plain pickle",
                    "tensors only, unless the folder is trusted",
                    "If you trust this folder, pass trusted=True.",
                )
            )
        else:
            plan.rest[name] = value
    return plan


def _raise_if(problems: list[FP8StateError], model: nn.Module, what: str) -> None:
    if problems:
        raise StateDictError(
            keys_of(problems),
            summarize(problems),
            f"a checkpoint whose {what} fit {type(model).__name__}",
            "Nothing was loaded; the model is unchanged.",
            problems,
        )


def dcp_load(
    model: nn.Module,
    checkpoint_id: str | os.PathLike[str],
    *,
    strict: bool = True,
    process_group: Any = None,
    key: str | None = None,
    storage_reader: Any = None,
    trusted: bool = False,
) -> Any:
    """Load a DCP checkpoint into ``model``, whatever the number of ranks that saved it.

    Collective: every rank of ``process_group`` calls it. DCP reads parameters *in place*,
    so everything that can be checked is checked before it reads them:

    1. The checkpoint's metadata against ``get_model_state_dict(model)``: missing keys
       (``strict``) and shape mismatches, all reported at once.
    2. The FP8 extra states are read into fresh CPU tensors and validated; on a problem the
       model is still unchanged.
    3. Parameters and buffers are read: each rank gets its own shards of FSDP2 parameters,
       full copies of everything else.
    4. :func:`fp8state.checkpoint.load_state_dict` loads it all; FP8 metadata lands on each
       module's own device.

    Args:
        model: Plain, DDP or FSDP2 model, built (or ``to_empty``-materialized) like the saver.
        checkpoint_id: The checkpoint folder.
        strict: Require every key of the model in the checkpoint (extra keys in the checkpoint,
            e.g. an optimizer's, are ignored).
        process_group: DCP's process group (None: the default group).
        key: The key the model was stored under (``dcp_save(..., key="model")``).
        storage_reader: Passed to ``dcp.load`` (default: DCP's ``FileSystemReader`` reading
            ``.metadata`` through fp8state's allow-list, or DCP's own with ``trusted``).
        trusted: Read ``.metadata`` (and any non-tensor item the model asks for) with plain
            pickle, as DCP does. By default nothing pickled in the folder runs, and a
            non-tensor item where the model has one is refused.

    Returns:
        The missing and unexpected keys, as ``load_state_dict`` returns them.

    Raises:
        StateDictError: missing keys, shape mismatches or invalid FP8 extra state; the model
            is unchanged.
        CheckpointError: DCP failed to read the folder.

    Example:
        In one process (no process group); with one, every rank makes the same calls.

        >>> import tempfile, torch, fp8state
        >>> from fp8state.checkpoint import dcp_load, dcp_save
        >>> folder = tempfile.mkdtemp()
        >>> saved = torch.nn.Sequential(fp8state.Linear(16, 16))
        >>> with fp8state.fp8_autocast():
        ...     _ = saved(torch.randn(4, 16))
        >>> _ = dcp_save(saved, folder, key="model")
        >>> fresh = torch.nn.Sequential(fp8state.Linear(16, 16))
        >>> dcp_load(fresh, folder, key="model")
        <All keys matched successfully>
        >>> torch.equal(fresh[0].fp8_meta("fwd").scale, saved[0].fp8_meta("fwd").scale)
        True
    """
    where = os.fspath(checkpoint_id)
    if storage_reader is not None:
        reader = storage_reader
    else:
        reader = dcp.FileSystemReader(where) if trusted else AllowListReader(where)
    with _dcp_call(where, "read"):
        md = reader.read_metadata()
    if not isinstance(reader, AllowListReader):  # which checked them as it read them
        check_fields(md, where)
        check_coverage(md, where)  # uncovered elements would keep the model's old values
    plan = _plan(get_model_state_dict(model), md, key, trusted)
    _raise_if(plan.mismatched + (plan.missing if strict else []), model, "keys and shapes")

    def read(part: dict[str, Any]) -> None:
        if part:
            with _dcp_call(where, "read"):
                dcp.load(
                    part if key is None else {key: part},
                    storage_reader=reader,
                    process_group=process_group,
                    no_dist=not _distributed(),
                )

    read(plan.extra)
    _, problems = validate_state_dict(model, plan.extra, strict=False)
    _raise_if(problems, model, "FP8 extra states")
    read(plan.rest)
    return load_state_dict(model, {**plan.rest, **plan.extra}, strict=strict)
