"""``tune_fallback``: time the user's own training step at each fallback threshold, keep the best.

Whether an eager FP8 GEMM pays depends on more than its size: the host queues its casts and
bookkeeping while the GPU runs whatever came before, so a GEMM that loses to bf16 on its own
(host-bound) can win inside a model whose GPU work hides that host time. No rule from one
GEMM's shape sees that; a measurement of the whole step does. The candidates are the step's
own GEMM sizes: threshold ``s`` runs in FP8 every GEMM of at least ``s`` multiply-accumulates.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fp8state import autocast
from fp8state._runtime import gemm_sizes, snapshot
from fp8state.errors import ConfigError
from fp8state.mixin import FP8StateMixin
from fp8state.tuning._ranks import slowest_over_ranks, union_over_ranks

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["tune_fallback", "FallbackTuning"]

_WHERE = "tune_fallback"


@dataclass(frozen=True)
class FallbackTuning:
    """What :func:`tune_fallback` measured and chose.

    Attributes:
        gemm_macs: The distinct sizes (multiply-accumulates, ``tokens * in * out``) of the
            GEMMs the step ran under ``fp8_autocast``, ascending; with several ranks, those
            of every rank.
        ms_per_step: Per candidate threshold (``fp8_min_gemm_macs``), the median milliseconds
            per step; with several ranks, the slowest rank's. The candidates are
            ``gemm_macs`` (threshold ``s``: FP8 for every GEMM of at least ``s``) and one more
            than the largest (every GEMM in high precision).
        chosen: The fastest candidate, now every tuned module's ``fp8_min_gemm_macs``
            (unless ``apply=False``).
        modules: Names (as in ``model.named_modules()``) of the tuned modules.

    Example:
        >>> from fp8state import FallbackTuning
        >>> tuning = FallbackTuning(
        ...     gemm_macs=(2**35, 2**37),
        ...     ms_per_step={2**35: 67.2, 2**37: 73.7, 2**37 + 1: 89.1},
        ...     chosen=2**35,
        ...     modules=("0.qkv", "0.proj"),
        ... )
        >>> tuning.fp8_gemm_macs(2**37) == (2**37,), tuning.fp8_gemm_macs(2**37 + 1)
        (True, ())
    """

    gemm_macs: tuple[int, ...]
    ms_per_step: dict[int, float]
    chosen: int
    modules: tuple[str, ...]

    def fp8_gemm_macs(self, threshold: int) -> tuple[int, ...]:
        """The step's GEMM sizes that run in FP8 under ``threshold``."""
        return tuple(s for s in self.gemm_macs if s >= threshold)


def _check_count(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(
            f"{_WHERE}({name}=...)", repr(value), f"an int >= {least}", f"Pass e.g. {name}=3."
        )


def _tunable(model: nn.Module) -> dict[str, FP8StateMixin]:
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{_WHERE}(model=...)",
            type(model).__name__,
            "a torch.nn.Module",
            "Pass the model whose FP8 modules the step runs.",
        )
    found = {n: m for n, m in model.named_modules() if isinstance(m, FP8StateMixin)}
    modules = {n: m for n, m in found.items() if not m.fp8_graphed}
    if not modules:
        raise ConfigError(
            f"{_WHERE}(model={type(model).__name__})",
            f"{len(found)} FP8 modules, {len(found) - len(modules)} of them graphed",
            "at least one FP8 module whose steps run eagerly",
            "Build the model from fp8state modules (or fp8state.convert_model it); graphed "
            "modules (make_graphed_callables) fixed their GEMMs' precision at capture.",
        )
    return modules


class _Restore:
    """Everything a trial step may change in the model, copied before the first."""

    def __init__(self, model: nn.Module, modules: Sequence[FP8StateMixin]) -> None:
        self.modules = modules
        self.thresholds = [m.fp8_min_gemm_macs for m in modules]
        self.caches = [dict(m.fp8_weight_cache) for m in modules]
        self.meta = snapshot.take(modules)
        self.buffers = snapshot.take_buffers(model, modules)
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.versions = [p._version for _, p in self.params]
        self.grads = [None if p.grad is None else p.grad.detach().clone() for _, p in self.params]

    def updated_parameter(self) -> str | None:
        """The name of a parameter the step changed in place (an optimizer step), if any."""
        for (name, p), version in zip(self.params, self.versions, strict=True):
            if p._version != version:
                return name
        return None

    @torch.no_grad()
    def put_back(self, thresholds: Sequence[int | None]) -> None:
        snapshot.put_back(self.meta)
        snapshot.put_back_buffers(self.buffers)
        for m, cache, threshold in zip(self.modules, self.caches, thresholds, strict=True):
            m.fp8_weight_cache.clear()
            m.fp8_weight_cache.update(cache)
            m.fp8_min_gemm_macs = threshold
        for (_, p), grad in zip(self.params, self.grads, strict=True):
            if grad is None:
                p.grad = None
            elif p.grad is not None:
                p.grad.copy_(grad)  # into the same tensor: DDP's buckets may view it
            else:
                p.grad = grad


def _ms_per_step(step: Callable[[], Any], calls: int, device: torch.device) -> float:
    """Milliseconds per call of ``calls`` calls back to back, synchronized only at the ends."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _: None)
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        step()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / calls


def tune_fallback(
    model: nn.Module,
    step: Callable[[], Any],
    *,
    steps: int = 5,
    repeats: int = 3,
    warmup: int = 2,
    apply: bool = True,
    group: ProcessGroup | None = None,
) -> FallbackTuning:
    """Time ``step`` at each fallback threshold and set the fastest on ``model``'s FP8 modules.

    ``step`` is one training step as the loop runs it, forward under ``fp8_autocast`` and
    backward, without the optimizer: the tuner calls it ``warmup + repeats * (steps + 1)``
    times per candidate plus once to hear the GEMM sizes, timing blocks of ``steps`` calls
    back to back (as a loop runs them: the host queues the next step while the GPU runs this
    one), candidates interleaved, medians over the blocks. Afterwards the model is as it was
    (FP8 metadata and step flags, FP8 weight caches, other buffers, ``.grad``, the random
    generators' states) except for the chosen threshold; meanwhile the tuner holds a copy of
    every gradient and of those buffers. With ``torch.distributed`` initialized, every rank
    of ``group`` times every GEMM size that any rank's step ran (batches may differ in length
    between ranks) and all keep the same threshold: the slowest rank's time decides.

    Args:
        model: The model whose eager FP8 modules are tuned (graphed ones keep theirs).
        step: A callable running one forward (under ``fp8_autocast``) and backward.
        steps: Calls per timed block.
        repeats: Timed blocks per candidate.
        warmup: Untimed calls per candidate first (FP8 kernels compile, scales settle).
        apply: Set the chosen threshold on the modules; False leaves theirs as they were.
        group: Process group the ranks agree over (None: the default group, when
            ``torch.distributed`` is initialized).

    Returns:
        A :class:`FallbackTuning` with the sizes, the time per candidate and the choice.

    Raises:
        ConfigError: a model without eager FP8 modules, bad counts, a call inside
            ``fp8_autocast``, a step that ran no FP8 GEMM under ``fp8_autocast`` eagerly (on
            any rank), or one that changed a parameter (an optimizer step); the model is left
            as it was.

    Example:
        >>> import torch, fp8state
        >>> model = torch.nn.Sequential(fp8state.Linear(64, 64), fp8state.Linear(64, 32))
        >>> x = torch.randn(16, 64)
        >>> def step():
        ...     with fp8state.fp8_autocast():
        ...         out = model(x)
        ...     out.sum().backward()
        >>> tuning = fp8state.tune_fallback(model, step, steps=1, repeats=1, warmup=0)
        >>> tuning.gemm_macs
        (32768, 65536)
        >>> model[0].fp8_min_gemm_macs == tuning.chosen
        True
    """
    for name, value, least in (("steps", steps, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        _check_count(name, value, least)
    if autocast.active_context() is not None:
        raise ConfigError(
            _WHERE,
            "a call inside fp8_autocast",
            "a call outside any fp8_autocast context",
            "Call tune_fallback outside fp8_autocast; the step opens its own.",
        )
    named = _tunable(model)
    modules = list(named.values())
    device = modules[0].fp8_meta("fwd").scale.device
    restore = _Restore(model, modules)
    cuda = []  # the CUDA generators to fork: the one of the metadata's device
    if device.type == "cuda":
        cuda = [torch.cuda.current_device() if device.index is None else device.index]
    try:
        with torch.random.fork_rng(devices=cuda):  # dropout draws must not shift training's
            ms = _trials(step, modules, restore, device, steps, repeats, warmup, group)
    except BaseException:
        restore.put_back(restore.thresholds)
        raise
    candidates = sorted(ms)
    slowest = slowest_over_ranks([ms[c] for c in candidates], group)
    times = dict(zip(candidates, slowest, strict=True))
    chosen = min(candidates, key=lambda c: (times[c], c))
    restore.put_back([chosen] * len(modules) if apply else restore.thresholds)
    return FallbackTuning(
        gemm_macs=tuple(candidates[:-1]),
        ms_per_step=times,
        chosen=chosen,
        modules=tuple(named),
    )


def _trials(
    step: Callable[[], Any],
    modules: Sequence[FP8StateMixin],
    restore: _Restore,
    device: torch.device,
    steps: int,
    repeats: int,
    warmup: int,
    group: ProcessGroup | None,
) -> dict[int, float]:
    """Median milliseconds per step for each candidate threshold (this rank's)."""
    with gemm_sizes.listening() as heard:
        step()
    _check_parameters(restore)
    # Every rank's sizes, before the check of what was heard: the ranks raise alike.
    sizes = union_over_ranks(list(heard), group)
    if not sizes:
        raise ConfigError(
            f"{_WHERE}(step=...)",
            "a step that ran no eager FP8 GEMM under fp8_autocast",
            "a step whose forward runs the model's FP8 modules inside fp8_autocast()",
            "Wrap the forward in fp8state.fp8_autocast(); compiled steps decide at trace "
            "time, so tune the eager step and compile afterwards.",
        )
    candidates = [*sizes, sizes[-1] + 1]  # the last: every GEMM in high precision

    def use(threshold: int) -> None:
        for m in modules:
            m.fp8_min_gemm_macs = threshold

    for threshold in candidates:
        use(threshold)
        for _ in range(warmup):
            step()
    blocks: dict[int, list[float]] = {c: [] for c in candidates}
    for _, threshold in itertools.product(range(repeats), candidates):
        use(threshold)
        step()  # the first call after a switch allocates anew: untimed
        blocks[threshold].append(_ms_per_step(step, steps, device))
    _check_parameters(restore)
    return {c: statistics.median(b) for c, b in blocks.items()}


def _check_parameters(restore: _Restore) -> None:
    updated = restore.updated_parameter()
    if updated is not None:
        raise ConfigError(
            f"{_WHERE}(step=...)",
            f"a step that changed parameter {updated!r} in place (an optimizer step?)",
            "a step that computes gradients and changes no parameter",
            "Pass a step without optimizer.step(); the FP8 metadata, buffers and gradients "
            "were put back, the parameters keep what the step did to them.",
        )
