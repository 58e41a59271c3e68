"""One module's forward records awaiting recomputation, and how a recomputation finds its own.

Each FP8 module has a :class:`ReplayLog`: per GEMM call site, two pools, because the two ways
``torch.utils.checkpoint`` runs tell a recomputation apart from its forward differently.

- **Non-reentrant** (``use_reentrant=False``, the default of PyTorch and Hugging Face): the
  forward runs with gradients under the checkpoint's saved-tensor hooks, and is recomputed
  under other hooks. Its records live in the :class:`GradPool`, anchored in the forward's
  autograd graph (a graph that is freed can no longer be recomputed) and consumed by their
  replay. A recomputation cannot tell which of several pending forwards of the module it
  belongs to; it replays one only when every pending record would replay the same numbers
  (one forward per backward, or several forwards within one scale step: weight sharing), and
  raises otherwise.
- **Reentrant** (``use_reentrant=True``): the forward runs under ``no_grad`` inside the
  checkpoint's autograd function, which is the node running when it is recomputed. Nodes are
  numbered in creation order per thread (autograd's sequence numbers), so the forward's calls
  are exactly the first ones recorded after that node: the :class:`NoGradPool` matches by
  number, whatever the order of backwards (micro-batches, pipeline schedules).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

import torch

from fp8state._runtime.forward_record import ForwardRecord, ForwardScales, site_name
from fp8state._runtime.friend import FP8Friend, set_plain_attr
from fp8state.errors import RecomputationError

__all__ = ["ReplayLog", "log_of", "GradPool", "NoGradPool", "POOL_LIMIT"]

#: Records a pool keeps; older ones are dropped, and a recomputation that may need one raises.
POOL_LIMIT = 64
_LOG_ATTR = "_fp8_replay_log"
_FIX = (
    "Checkpoint this function with fp8state.functional.activation_checkpoint(fn, *args, "
    "use_reentrant=...), which replays each checkpoint's own forward exactly."
)


class _Thread(threading.local):
    def __init__(self) -> None:
        self.token = object()  # sequence numbers count per thread: compare within one


_THREAD = _Thread()


class ReplayLog:
    """A module's pending forward records by call site, and its shared copy of the scales."""

    def __init__(self) -> None:
        self.grad: dict[int, GradPool] = {}
        self.no_grad: dict[int, NoGradPool] = {}
        self._scales: ForwardScales | None = None
        self._stamp: tuple[int, ...] | None = None
        # The live buffers the copy was taken from, weakly (compared by identity).
        self._sources: tuple[weakref.ref[torch.Tensor], ...] = ()

    def __reduce__(self) -> tuple[type[ReplayLog], tuple[()]]:
        # A pickled or deep-copied module has no forward awaiting recomputation.
        return (ReplayLog, ())

    def scales(self, module: FP8Friend) -> ForwardScales:
        """A copy of the module's live forward scales, shared until they may have changed.

        They change only where the module's mutation count moves (an update or load through
        it), a version counter (an in-place edit) or the buffers themselves (``.to()``).
        """
        meta = module.fp8_meta("fwd")
        stamp = (module._fp8_mutation_count(), meta.scale._version, meta.scale_inv._version)
        if self._scales is None or stamp != self._stamp or not self._same_sources(module):
            self._scales = ForwardScales(meta.scale, meta.scale_inv)
            self._sources = (weakref.ref(meta.scale), weakref.ref(meta.scale_inv))
        self._stamp = stamp
        return self._scales

    def _same_sources(self, module: FP8Friend) -> bool:
        meta = module.fp8_meta("fwd")
        live = (meta.scale, meta.scale_inv)
        return len(self._sources) == 2 and all(
            r() is t for r, t in zip(self._sources, live, strict=True)
        )

    def after_forward(self, module: FP8Friend, scales: ForwardScales) -> None:
        """Note that the call that took ``scales`` has cast.

        Its own amax records moved the mutation count but changed no scale.
        """
        if scales is self._scales and self._stamp is not None:
            meta = module.fp8_meta("fwd")
            self._stamp = (
                module._fp8_mutation_count(),
                meta.scale._version,
                meta.scale_inv._version,
            )

    def grad_pool(self, site: int) -> GradPool:
        pool = self.grad.get(site)
        if pool is None:
            pool = self.grad[site] = GradPool()
        return pool

    def no_grad_pool(self, site: int) -> NoGradPool:
        pool = self.no_grad.get(site)
        if pool is None:
            pool = self.no_grad[site] = NoGradPool()
        return pool


def log_of(module: FP8Friend, create: bool = True) -> ReplayLog | None:
    """``module``'s replay log (made on first use when ``create``)."""
    log = module.__dict__.get(_LOG_ATTR)
    if log is None and create:
        log = ReplayLog()
        set_plain_attr(module, _LOG_ATTR, log)
    return log


class GradPool:
    """Records of forwards run under saved-tensor hooks (non-reentrant checkpoints)."""

    def __init__(self) -> None:
        # Weak references where the forward's graph holds the record, the record itself
        # where nothing could (an output without a graph).
        self.entries: list[weakref.ref[ForwardRecord] | ForwardRecord] = []
        self.lost = False

    def add(self, record: ForwardRecord, anchored: bool) -> None:
        self.entries.append(weakref.ref(record) if anchored else record)
        if len(self.entries) > POOL_LIMIT:
            self._prune()
            if len(self.entries) > POOL_LIMIT:
                del self.entries[0]
                self.lost = True  # a recomputation may now miss its forward: refuse any

    def _prune(self) -> list[ForwardRecord]:
        live = []
        kept: list[weakref.ref[ForwardRecord] | ForwardRecord] = []
        for entry in self.entries:
            record = entry() if isinstance(entry, weakref.ref) else entry
            if record is not None and not record.taken:
                live.append(record)
                kept.append(entry)
        self.entries = kept
        return live

    def take(self, module: object, site: int) -> ForwardRecord | None:
        """The record to replay (consumed), None where none is pending.

        Raises:
            RecomputationError: pending records would replay different numbers.
        """
        live = self._prune()
        if not live:
            return None
        if self.lost:
            raise RecomputationError(
                site_name(module, site),
                f"more than {POOL_LIMIT} forwards awaiting recomputation; older ones dropped",
                "a record of the forward being recomputed",
                _FIX,
            )
        first = live[0]
        if not all(first.same_replay(r) for r in live[1:]):
            raise RecomputationError(
                site_name(module, site),
                f"{len(live)} forwards awaiting recomputation with different FP8 scales or "
                "settings (several micro-batches or pipeline stages in flight before their "
                "backward), so which one this recomputation replays is ambiguous",
                "one FP8 state among the module's forwards that a recomputation may belong to",
                _FIX,
            )
        del self.entries[0]
        first.taken = True
        return first


class _Entry:
    __slots__ = ("q", "record", "used")

    def __init__(self, q: int, record: ForwardRecord | None) -> None:
        self.q = q  # the thread's next autograd sequence number when the call ran
        self.record = record  # None: calls that kept nothing (eval mode), a run of them
        self.used: tuple[int, int] | None = None  # (backward pass, node) that replayed it


class NoGradPool:
    """Records of forwards run without gradients (reentrant checkpoints), by sequence number."""

    def __init__(self) -> None:
        self.entries: deque[_Entry] = deque()
        self.thread: object | None = None
        self.mixed = False
        self.retired = -1  # the highest sequence number of a record dropped or retired

    def add(self, record: ForwardRecord | None) -> None:
        """Append the record of a call running now; None for a call that kept nothing."""
        q = torch._C._autograd._get_sequence_nr()
        token = _THREAD.token
        entries = self.entries
        while entries and entries[0].used is None and entries[0].record is not None:
            if not entries[0].record.taken:
                break
            self.retired = max(self.retired, entries.popleft().q)  # replayed from the other pool
        if self.thread is None:
            self.thread = token
        elif token is not self.thread:
            self.mixed = True
        last = self.entries[-1] if self.entries else None
        if record is None and last is not None and last.record is None and last.used is None:
            last.q = q  # a run of calls that kept nothing is one entry, up to its last call
            return
        self.entries.append(_Entry(q, record))
        if len(self.entries) > POOL_LIMIT:
            self.retired = max(self.retired, self.entries.popleft().q)

    def take(
        self, module: object, site: int, node: object | None, task: int
    ) -> ForwardRecord | None:
        """The record of the next call of the forward ``node`` ran, None where none was kept.

        Raises:
            RecomputationError: the record may be gone, or was replayed by another pass.
        """
        if not self.entries and self.retired < 0:
            return None
        where = site_name(module, site)
        if node is None or self.mixed:
            raise RecomputationError(
                where,
                "a recomputation outside a checkpoint's backward node"
                if node is None
                else "forwards of the module recorded on several threads",
                "one reentrant checkpoint's recomputation of forwards run on one thread",
                _FIX,
            )
        after = node._sequence_nr()  # type: ignore[attr-defined]
        if self.retired > after:
            raise RecomputationError(
                where,
                "a recomputation whose forward's record was already retired (the segment "
                "recomputed a second time with retain_graph=True, backwards run in another "
                f"order than their forwards, or more than {POOL_LIMIT} forwards pending)",
                "each reentrant checkpoint recomputed once, its backwards in forward order",
                _FIX,
            )
        key = (task, id(node))
        for entry in self.entries:
            if entry.q <= after or entry.used == key:
                continue
            if entry.used is not None:
                raise RecomputationError(
                    where,
                    "a recomputation of a forward already recomputed by another backward pass",
                    "one recomputation per reentrant checkpoint",
                    _FIX,
                )
            if entry.record is None:
                raise RecomputationError(
                    where,
                    "a recomputation of a forward run in eval mode under no_grad, which "
                    "keeps nothing to replay",
                    "a reentrant checkpoint's forward run in training mode",
                    "Call model.train() before the checkpointed forward. " + _FIX,
                )
            entry.used = key
            entry.record.taken = True
            _retire_at_end(task, self)
            return entry.record
        return None

    def retire(self, task: int) -> None:
        """Drop what backward pass ``task`` replayed, and every record older than that."""
        used = [e.q for e in self.entries if e.used is not None and e.used[0] == task]
        if not used:
            return
        upto = max(used)
        while self.entries and self.entries[0].q <= upto:
            self.entries.popleft()
        self.retired = max(self.retired, upto)


# Per backward pass, the pools it replayed from; they retire its records when it ends.
_RETIRING: dict[int, set[NoGradPool]] = {}
_RETIRING_LOCK = threading.Lock()


def _retire_at_end(task: int, pool: NoGradPool) -> None:
    with _RETIRING_LOCK:
        pools = _RETIRING.get(task)
        first = pools is None
        if first:
            pools = _RETIRING[task] = set()
        assert pools is not None
        pools.add(pool)
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _retire(task))


def _retire(task: int) -> None:
    with _RETIRING_LOCK:
        pools = _RETIRING.pop(task, set())
    for pool in pools:
        pool.retire(task)
