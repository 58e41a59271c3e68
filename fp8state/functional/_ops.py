"""fp8state's casts as custom operators: what a compiled graph calls instead of the eager code.

Dynamo turns the Python state it reads into guards and the Python state it writes into side
effects replayed after the graph. A cast's bookkeeping is exactly such state, and it changes
every step: whether the record opens a new step, the mutation count, the modules registered
for the step's scale update, autograd's end-of-backward callback. Traced, it would recompile
every step or break the graph. So under ``torch.compile`` each cast is one ``torch.library``
operator: the graph sees a function of tensors, and at runtime the operator runs the eager
path's own code (open the step, cast and record, register the module) on the module's own
buffers. The module travels as its handle (:mod:`fp8state._runtime.handles`); the graph's
guards never see its Python state, and its buffers are never graph inputs that the graph
would copy (functionalization) and write back later than the scale update reads them.

Inductor calls the operators as they are: fp8state's Triton kernels run inside them, neither
re-lowered nor compiled again; the FP8 GEMM too (``fp8state::gemm``). In a mode with CUDA
graphs (``"reduce-overhead"``), Inductor runs the casts, the GEMM and a compiled context's
exit between its CUDA graphs (``torch.Tag.cudagraph_unsafe``): the casts and the exit because
their Python must run at every step, the GEMM because its FP8 operands come out of the casts
at new addresses every step, and a backward CUDA graph holding it would take the operands the
forward saved as static inputs, which torch records again at every step instead of replaying.
"""

from typing import cast

import torch

from fp8state import autocast
from fp8state._runtime import handles, microbatch
from fp8state._runtime.context_stack import TAGS, TOKEN, context_of
from fp8state._runtime.operators import define
from fp8state.backends import fp8_gemm
from fp8state.errors import ConfigError, RecomputationError
from fp8state.functional._slot import cast_for, weight_for
from fp8state.mixin import FP8StateMixin
from fp8state.quantize import finite_amax
from fp8state.slots import Direction

__all__ = ["cast_op", "weight_op", "record_op", "gemm_op", "refuse"]


def _module(handle: torch.Tensor, what: str) -> FP8StateMixin:
    return cast(FP8StateMixin, handles.module_of(handle, what))


def _forward(module: FP8StateMixin, what: str, context: int, register: bool) -> None:
    """A forward record's bookkeeping: not in a recomputation; registered where asked."""
    if torch._C._current_graph_task_id() != -1:
        raise RecomputationError(
            f"{type(module).__name__} ({what})",
            "a compiled FP8 forward run again during backward (activation checkpointing "
            "around or inside the compiled call)",
            "compiled forwards run once, outside backward",
            "Checkpoint eagerly with fp8state.functional.activation_checkpoint, or compile "
            "the blocks without checkpointing them.",
        )
    if microbatch.first_microbatch(None) is not None or microbatch.casting_ahead():
        raise ConfigError(
            f"{type(module).__name__} ({what})",
            "a compiled FP8 call while is_first_microbatch is in force (graphs captured with "
            "fp8_weight_caching, their eager calls, or a cast_weights_ahead block)",
            "no compiled FP8 call inside such a capture or block (the flag they assume never "
            "reaches a compiled call, whether or not the call passes is_first_microbatch)",
            "Call the module uncompiled there, or graph without fp8_weight_caching and "
            "compile without cast_weights_ahead.",
        )
    if register:  # under an fp8_autocast entered before the graph ran
        if autocast.active_context() is None:  # pragma: no cover - the graph's guards
            raise ConfigError(
                f"{type(module).__name__} ({what})",
                "a graph compiled under fp8_autocast running outside any",
                "the compiled call inside the fp8_autocast it was compiled under",
                "Enter fp8_autocast around the call of the compiled function or module.",
            )
        autocast.register_forward(module, context_of(context))


def _cast(
    x: torch.Tensor,
    handle: torch.Tensor,
    context: int,
    register: bool,
    direction: str,
    slot: int,
    fp8_dtype: torch.dtype,
    transpose: bool,
    column_sums: bool,
    op: str,
    aux: torch.Tensor | None,
    token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One slot's cast of a compiled graph: the eager path's own code on the module's buffers.

    Arguments as :func:`fp8state.functional._slot.cast_for`'s, with the module as its handle
    (:func:`fp8state._runtime.handles.handle_of`).
    The direction's step is opened and the module registered for that direction's scale
    update under the ``fp8_autocast`` numbered ``context`` (forward: where ``register``,
    else the graph's own context exit does it).
    The module's metadata buffers are not arguments: the operator reads and writes them
    itself, ordered among fp8state's operators by ``token``
    (:data:`fp8state._runtime.context_stack.TOKEN`), so the graph never copies them.
    Operators return tensors only: a transpose or column sums not asked for come back empty.
    """
    module = _module(handle, f"fp8state::cast_slot (slot {slot})")
    if direction == "fwd":
        _forward(module, f"slot {slot}", context, register)
    else:
        autocast.register_backward(module, context_of(context))
    side = cast(Direction, direction)  # "fwd" or "bwd", written by _compiled
    x_fp8, x_fp8_t, snapshot, sums = cast_for(
        module,
        side,
        slot,
        x,
        fp8_dtype,
        transpose,
        column_sums,
        op,
        aux,  # type: ignore[arg-type]
    )
    if x_fp8_t is None:
        x_fp8_t = x_fp8.new_empty(0)
    if sums is None:
        sums = x.new_empty(0, dtype=_sums_dtype(x, op))
    return x_fp8, x_fp8_t, snapshot, sums


def _sums_dtype(x: torch.Tensor, op: str) -> torch.dtype:
    # As cast_slot sums: in the input's dtype for the identity, float32 after an op.
    return x.dtype if op == "identity" else torch.float32


def _cast_fake(
    x: torch.Tensor,
    handle: torch.Tensor,
    context: int,
    register: bool,
    direction: str,
    slot: int,
    fp8_dtype: torch.dtype,
    transpose: bool,
    column_sums: bool,
    op: str,
    aux: torch.Tensor | None,
    token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    x_fp8 = x.new_empty((rows, cols), dtype=fp8_dtype)
    x_fp8_t = x.new_empty((cols, rows) if transpose else (0,), dtype=fp8_dtype)
    sums = x.new_empty((cols,) if column_sums else (0,), dtype=_sums_dtype(x, op))
    return x_fp8, x_fp8_t, x.new_empty(1, dtype=torch.float32), sums


cast_op = define(
    "cast_slot",
    "(Tensor x, Tensor handle, int context, bool register, str direction, int slot, "
    "ScalarType fp8_dtype, bool transpose, bool column_sums, str op, Tensor? aux, "
    "Tensor(t!) token) -> (Tensor, Tensor, Tensor, Tensor)",
    _cast,
    _cast_fake,
    TAGS,
)


def _weight(
    weight: torch.Tensor,
    handle: torch.Tensor,
    context: int,
    register: bool,
    gemm: int,
    fp8_dtype: torch.dtype,
    transpose: bool,
    first: bool,
    token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A compiled call's FP8 weight under ``is_first_microbatch=first``: the eager path's cache.

    :func:`fp8state.functional._slot.weight_for` reuses or casts and keeps, as eagerly. The
    graph gets copies of the cached tensors, never the tensors themselves: an operator's
    outputs belong to the graph, whose memory planning may reuse the storage of dead ones
    (docs/decisions.md).
    """
    module = _module(handle, f"fp8state::cached_weight (GEMM {gemm})")
    _forward(module, f"GEMM {gemm} weight", context, register)
    (x_fp8, x_fp8_t, inv), _ = weight_for(module, gemm, weight, fp8_dtype, transpose, first)
    # Only the layouts the call asked for (a cached transpose the call does not need stays).
    t_copy = x_fp8_t.clone() if transpose and x_fp8_t is not None else x_fp8.new_empty(0)
    return x_fp8.clone(), t_copy, inv.clone()


def _weight_fake(
    weight: torch.Tensor,
    handle: torch.Tensor,
    context: int,
    register: bool,
    gemm: int,
    fp8_dtype: torch.dtype,
    transpose: bool,
    first: bool,
    token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x_fp8, x_fp8_t, inv, _ = _cast_fake(
        weight, handle, context, register, "fwd", 0, fp8_dtype, transpose, False, "identity",
        None, token,
    )  # fmt: skip
    return x_fp8, x_fp8_t, inv


weight_op = define(
    "cached_weight",
    "(Tensor weight, Tensor handle, int context, bool register, int gemm, "
    "ScalarType fp8_dtype, bool transpose, bool first, Tensor(t!) token) "
    "-> (Tensor, Tensor, Tensor)",
    _weight,
    _weight_fake,
    TAGS,
)


def _record(
    x: torch.Tensor,
    handle: torch.Tensor,
    context: int,
    register: bool,
    slot: int,
    token: torch.Tensor,
) -> None:
    """A forward amax record of a compiled calibration step (no cast), as the eager one."""
    module = _module(handle, f"fp8state::record_amax (slot {slot})")
    _forward(module, f"slot {slot}", context, register)
    module.fp8_record_amax("fwd", slot, finite_amax(x))


def _record_fake(
    x: torch.Tensor,
    handle: torch.Tensor,
    context: int,
    register: bool,
    slot: int,
    token: torch.Tensor,
) -> None:
    return None


record_op = define(
    "record_amax",
    "(Tensor x, Tensor handle, int context, bool register, int slot, Tensor(t!) token) -> ()",
    _record,
    _record_fake,
    TAGS,
)


def _gemm(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str,
    bias: torch.Tensor | None,
    fast_accum: bool,
) -> torch.Tensor:
    """:func:`fp8state.backends.fp8_gemm`, called as it is.

    Inductor's own lowering of ``torch._scaled_mm`` fails on operands that come out of an
    operator (torch 2.11, ``max-autotune``), and would not be faster: cuBLAS runs either way.
    Outside CUDA graphs, as the casts: a backward graph that multiplied the FP8 operands the
    forward's casts saved would take them as static inputs, at new addresses every step.
    """
    out, _ = fp8_gemm(a, a_inv, b, b_inv, out_dtype, backend, bias=bias, fast_accum=fast_accum)
    return out


def _gemm_fake(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str,
    bias: torch.Tensor | None,
    fast_accum: bool,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


gemm_op = define(
    "gemm",
    "(Tensor a, Tensor a_inv, Tensor b, Tensor b_inv, ScalarType out_dtype, str backend, "
    "Tensor? bias, bool fast_accum) -> Tensor",
    _gemm,
    _gemm_fake,
    TAGS,
)


# Errors a compiled graph raises at runtime, by number (Dynamo cannot build them in a trace).
_REFUSALS: dict[tuple[str, ...], int] = {}
_ERRORS: list[ConfigError] = []


@torch.compiler.assume_constant_result
def _refusal(key: str, found: str, expected: str, fix: str) -> int:
    fields = (key, found, expected, fix)
    number = _REFUSALS.get(fields)
    if number is None:
        number = _REFUSALS[fields] = len(_ERRORS)
        _ERRORS.append(ConfigError(*fields))
    return number


def refuse(key: str, found: str, expected: str, fix: str) -> None:
    """Raise a :class:`~fp8state.errors.ConfigError` from a graph being compiled, when it runs."""
    _refuse_op(TOKEN, _refusal(key, found, expected, fix))


def _refuse(token: torch.Tensor, error: int) -> None:
    raise _ERRORS[error]


def _refuse_fake(token: torch.Tensor, error: int) -> None:
    return None


_refuse_op = define("refuse", "(Tensor(t!) token, int error) -> ()", _refuse, _refuse_fake)
