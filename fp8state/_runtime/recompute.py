"""Activation recomputation: tell it from a forward, and replay each FP8 call of it exactly.

``torch.utils.checkpoint`` (and Hugging Face's gradient checkpointing, which calls it) runs a
checkpointed function twice: in forward, and again during backward to rebuild what backward
needs. The second run comes after the forward's ``fp8_autocast`` exited and updated the
scales, often outside any ``fp8_autocast``: run as a plain forward it would compute in high
precision, or with other scales, and record every amax a second time.

So each FP8 GEMM call of :mod:`fp8state.functional` starts with :func:`replaying`:

- A call that runs while autograd's engine executes a backward on this thread (or inside a
  replaying scope of the drop-in, :mod:`.replay_scope`) is a recomputation. :func:`take` finds
  the record of its forward, and the call replays it: the same FP8-or-not decision and
  backend, the same scales, the same cached weights, no amax record, no step bookkeeping.
- Any other call is a forward. Where a recomputation may follow (under the saved-tensor hooks
  of a non-reentrant checkpoint, under ``no_grad`` as in a reentrant one, or inside the
  drop-in), :func:`start` keeps a :class:`~.forward_record.ForwardRecord` and :func:`finish`
  files it (:mod:`.replay_log` says how a recomputation finds its own). Elsewhere, the training
  loop's hot path, it keeps nothing.

Where the match is ambiguous or the record is missing, :func:`take` raises
:class:`~fp8state.errors.RecomputationError` rather than compute other numbers.
"""

from __future__ import annotations

from typing import cast

import torch

from fp8state._runtime import replay_scope
from fp8state._runtime.forward_record import HIGH_PRECISION, ForwardRecord, site_name
from fp8state._runtime.friend import FP8Friend
from fp8state._runtime.replay_log import log_of
from fp8state.errors import RecomputationError

__all__ = ["replaying", "hooks_active", "start", "finish", "take", "refuse_forward_record"]

# Where a forward's autograd node keeps the records it anchors (Node.metadata).
_ANCHOR_KEY = "fp8state.forward_records"


def replaying() -> bool:
    """Whether an FP8 call running now is a recomputation of an earlier forward."""
    return torch._C._current_graph_task_id() != -1 or replay_scope.any_replay()


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def hooks_active() -> bool:
    """Whether a ``torch.autograd.graph.saved_tensors_hooks`` context is active.

    Asked through a private torch function; where it is missing, assume hooks are active.
    """
    if _TOP_HOOKS is None:
        return True
    try:
        return _TOP_HOOKS(False) is not None
    except TypeError:  # an older signature without the tracing flag
        return _TOP_HOOKS() is not None


def start(
    module: FP8Friend, site: int, ctx: object | None, backend: str | None
) -> ForwardRecord | None:
    """A forward call begins: its record to fill, or None where no recomputation can follow.

    Args:
        module: The FP8 module.
        site: The call: its GEMM index, or ``forward_record.MLP_SITE``.
        ctx: The ``fp8_autocast`` context in force, None outside any.
        backend: The FP8 GEMM backend chosen, None for high precision.
    """
    frames = replay_scope.recording()
    if frames:  # inside the drop-in: the checkpoint's own scope keeps the record
        record = _new(module, ctx, backend, hold_weights=True)
        for frame in frames:
            frame.append(module, site, record)
        return record
    if torch.is_grad_enabled():
        if not hooks_active():
            return None  # no checkpoint can recompute this call: the hot path keeps nothing
        record = _new(module, ctx, backend)
        record.grad_pending = True
        return record
    if torch.is_inference_mode_enabled():
        return None
    log = log_of(module)
    assert log is not None
    pool = log.no_grad_pool(site)
    if not getattr(module, "training", True):
        pool.add(None)  # evaluation keeps no copy of the scales, only where it ran
        return None
    record = _new(module, ctx, backend)
    pool.add(record)
    if hooks_active():
        # Under no_grad inside a non-reentrant checkpoint (which recomputes under hooks and
        # looks in the other pool), or a reentrant one run under save_on_cpu: keep it for both.
        log.grad_pool(site).add(record, anchored=False)
    return record


def _new(
    module: FP8Friend,
    ctx: object | None,
    backend: str | None,
    *,
    hold_weights: bool = False,
) -> ForwardRecord:
    if backend is None:  # high precision: nothing to cast with
        return ForwardRecord(ctx, None, None)
    log = log_of(module)
    assert log is not None
    return ForwardRecord(ctx, backend, log.scales(module), hold_weights=hold_weights)


def finish(
    module: FP8Friend, site: int, record: ForwardRecord, anchor: torch.Tensor | None
) -> None:
    """The call has run; ``anchor`` is a tensor of its autograd graph (its output, say)."""
    log = log_of(module)
    assert log is not None
    if record.scales is not None:
        log.after_forward(module, record.scales)
    if record.grad_pending:
        record.grad_pending = False
        node = anchor.grad_fn if anchor is not None else None
        if node is not None:  # the graph holds the record as long as it can be recomputed
            metadata = cast(dict[str, list[ForwardRecord]], node.metadata)
            metadata.setdefault(_ANCHOR_KEY, []).append(record)
        log.grad_pool(site).add(record, anchored=node is not None)


def take(module: FP8Friend, site: int) -> ForwardRecord:
    """The record a recomputation of this call replays.

    Raises:
        RecomputationError: the forward cannot be told apart from others with other FP8
            state, or kept no record.
    """
    frame = replay_scope.innermost_replay()
    record = frame.take(module, site) if frame is not None else _from_log(module, site)
    for inner in replay_scope.recording():  # a drop-in's first run inside this replay
        inner.append(module, site, record)
    return record


def _from_log(module: FP8Friend, site: int) -> ForwardRecord:
    if getattr(module, "fp8_last_gemm_backend", "none") == "none":
        # Never ran a GEMM under fp8_autocast(enabled=True): every forward computed in high
        # precision (calibration too), so the replay does, whatever the records say.
        return HIGH_PRECISION
    log = log_of(module, create=False)
    record = None
    if log is not None:
        if hooks_active():  # a non-reentrant checkpoint recomputes under hooks of its own
            grad_pool = log.grad.get(site)
            record = grad_pool.take(module, site) if grad_pool is not None else None
        else:
            pool = log.no_grad.get(site)
            if pool is not None:
                node = torch._C._current_autograd_node()
                record = pool.take(module, site, node, torch._C._current_graph_task_id())
    if record is not None:
        return record
    raise RecomputationError(
        site_name(module, site),
        "a recomputation with no record of its forward (the segment recomputed a second "
        "time, checkpoints nested in each other, the forward run with gradients outside "
        "any checkpoint, or a forward run during a backward pass that is no recomputation)",
        "the record kept by the forward of a checkpointed function",
        "Checkpoint this function with fp8state.functional.activation_checkpoint(fn, *args, "
        "use_reentrant=...), which keeps each checkpoint's own records.",
    )


def refuse_forward_record(module: FP8Friend) -> None:
    """Raise where a module records a forward amax itself while a forward is recomputed.

    fp8state's own calls replay without recording; a module that quantizes with its live
    scales and records through ``fp8_record_amax`` would record a second time, with the
    next step's scales: other numbers, so an error instead.

    Raises:
        RecomputationError: a recomputation is running.
    """
    if replaying():
        raise RecomputationError(
            f"{type(module).__name__}.fp8_record_amax",
            "a forward amax recorded by the module itself during an activation recomputation",
            "forward amaxes recorded once, by the forward (fp8state.functional replays them)",
            "Compute the module's GEMMs with fp8state.functional.fp8_linear, whose "
            "recomputations replay their forward exactly, or do not checkpoint this module.",
        )
