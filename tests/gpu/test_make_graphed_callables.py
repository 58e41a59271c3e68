"""fp8state.make_graphed_callables on a GPU: replays equal eager FP8 steps, bit for bit.

Each case graphs a module (or a chain of modules sharing one pool) and runs a twin with the
same parameters and metadata eagerly under ``fp8_autocast``; both take the same steps (new
inputs, an in-place SGD update), and outputs, gradients, every FP8 buffer and the state dicts
must agree after every step, also across a checkpoint saved and loaded between replays. What a
graph cannot follow (shapes, replaced tensors, other FP8 settings) raises. Skipped without
CUDA.
"""

from __future__ import annotations

import gc
import io
from collections.abc import Callable

import pytest
import torch
from _helpers.models import Gated
from torch import nn

import fp8state
from fp8state.errors import ConfigError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
H, TOKENS, STEPS = 256, 128, 6
KW = {"params_dtype": torch.bfloat16, "device": CUDA}

BUILD: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: fp8state.Linear(H, H, **KW),
    "LayerNormLinear": lambda: fp8state.LayerNormLinear(H, H, **KW),
    "LayerNormMLP": lambda: fp8state.LayerNormMLP(H, 2 * H, **KW),
    "RMSNorm-swiglu-MLP": lambda: fp8state.LayerNormMLP(
        H, 2 * H, normalization="RMSNorm", activation="swiglu", **KW
    ),
}


def _pair(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    graphed, eager = build(), build()
    for module in (*graphed.modules(), *eager.modules()):
        if isinstance(module, fp8state.FP8StateMixin):
            module.fp8_min_gemm_macs = 0  # FP8 at this size too
    eager.load_state_dict(graphed.state_dict())
    return graphed, eager


def _input(step: int) -> torch.Tensor:
    gen = torch.Generator(device=CUDA).manual_seed(step)
    x = torch.randn(TOKENS, H, generator=gen, device=CUDA) * (step + 1)
    return x.to(torch.bfloat16).requires_grad_()


def _step(
    model: nn.Module, x: torch.Tensor, eager: bool, update: bool = True, **kwargs: object
) -> dict[str, torch.Tensor]:
    """One fwd+bwd: what it computed and left; ``update``: then an SGD step (else gradients
    accumulate). ``kwargs`` go to the forward (tensors: their gradients are seen too)."""
    if eager:
        with fp8state.fp8_autocast():
            y = model(x, **kwargs)
    else:
        y = model(x, **kwargs)
    y.float().pow(2).mean().backward()
    seen = {"y": y.detach().clone(), "x.grad": x.grad.clone()}
    tensors = {k: t for k, t in kwargs.items() if isinstance(t, torch.Tensor)}
    seen.update({f"{name}.grad": t.grad.clone() for name, t in tensors.items()})
    seen.update({f"{name}.grad": p.grad.clone() for name, p in model.named_parameters()})
    if update:
        _optimizer_step(model)
    seen.update({name: b.clone() for name, b in model.named_buffers()})
    return seen


def _optimizer_step(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], step: int) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), (step, key)


def _assert_state_dicts_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key].cpu(), sb[key].cpu()), key


@pytest.mark.parametrize("kind", sorted(BUILD))
def test_replays_equal_eager_steps_bit_for_bit(kind: str) -> None:
    graphed, eager = _pair(BUILD[kind])
    fp8state.make_graphed_callables(graphed, (_input(100),))
    # The warm-up steps left no trace: both start from the same metadata.
    _assert_state_dicts_equal(graphed, eager)
    for step in range(STEPS):
        _assert_equal(_step(graphed, _input(step), False), _step(eager, _input(step), True), step)
        _assert_state_dicts_equal(graphed, eager)  # state_dict sees what the replays wrote
    fp8 = [m for m in graphed.modules() if isinstance(m, fp8state.FP8StateMixin)]
    # Every replay recorded: the input and weight slots of the first GEMM hold amaxes.
    assert fp8 and fp8[0].fp8_meta("fwd").amax_history[:STEPS, :2].gt(0).all()


def test_a_chain_of_modules_shares_a_pool_and_equals_eager() -> None:
    # Nine blocks of two FP8 modules: each block's scale updates run batched, through pointer
    # tables (18, more than the eager cache keeps), all made in warm-up and kept by the graphs.
    def block() -> nn.Sequential:
        return nn.Sequential(
            fp8state.LayerNormLinear(H, H, **KW), fp8state.LayerNormMLP(H, 2 * H, **KW)
        )

    def chain() -> nn.Sequential:
        return nn.Sequential(*(block() for _ in range(9)))

    graphed, eager = _pair(chain)
    samples = []
    x = _input(100)
    for layer in graphed:
        samples.append((x,))
        x = layer(x).detach().requires_grad_()
    fp8state.make_graphed_callables(tuple(graphed), tuple(samples))
    for step in range(STEPS):
        _assert_equal(_step(graphed, _input(step), False), _step(eager, _input(step), True), step)


def test_keyword_tensors_are_captured_and_replayed() -> None:
    graphed, eager = _pair(lambda: Gated(H, **KW))
    fp8state.make_graphed_callables(graphed, (_input(100),), sample_kwargs={"gate": _input(99)})
    _assert_state_dicts_equal(graphed, eager)
    for step in range(STEPS):
        got = _step(graphed, _input(step), False, gate=_input(step + 50))
        want = _step(eager, _input(step), True, gate=_input(step + 50))
        assert "gate.grad" in got  # the keyword tensor's gradient comes back too
        _assert_equal(got, want, step)
    with pytest.raises(ConfigError, match="keyword arguments"):
        graphed(_input(0))  # the captured keyword missing
    with pytest.raises(ConfigError, match="argument 'gate'.*shape"):
        graphed(_input(0), gate=_input(0)[:1])


def test_a_checkpoint_saved_and_loaded_between_replays() -> None:
    graphed, eager = _pair(BUILD["LayerNormMLP"])
    fp8state.make_graphed_callables(graphed, (_input(100),))
    for step in range(3):
        _assert_equal(_step(graphed, _input(step), False), _step(eager, _input(step), True), step)
    buffer = io.BytesIO()
    torch.save(graphed.state_dict(), buffer)
    for step in range(3, 5):  # both move on, then both go back to the checkpoint
        _step(graphed, _input(step), False)
        _step(eager, _input(step), True)
    for model in (graphed, eager):
        buffer.seek(0)
        model.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(3, 7):
        _assert_equal(_step(graphed, _input(step), False), _step(eager, _input(step), True), step)


def test_eval_mode_runs_eagerly_under_the_graphs_settings() -> None:
    graphed, eager = _pair(BUILD["Linear"])
    fp8state.make_graphed_callables(graphed, (_input(100),))
    graphed.eval()
    eager.eval()
    x = _input(1).detach()
    with torch.no_grad(), fp8state.fp8_autocast():
        want = eager(x)
    with torch.no_grad():
        assert torch.equal(graphed(x), want)
    _assert_state_dicts_equal(graphed, eager)


def test_fp8_disabled_graphs_compute_in_high_precision() -> None:
    graphed, eager = _pair(BUILD["Linear"])
    fp8state.make_graphed_callables(graphed, (_input(100),), fp8_enabled=False)
    x, x_eager = _input(1), _input(1)
    y = graphed(x)
    with fp8state.fp8_autocast(enabled=False):
        y_eager = eager(x_eager)
    assert torch.equal(y, y_eager)


def test_what_a_graph_cannot_follow_raises() -> None:
    graphed, _ = _pair(BUILD["Linear"])
    fp8state.make_graphed_callables(graphed, (_input(100),))
    with pytest.raises(ConfigError, match="argument 0"):
        graphed(torch.randn(2 * TOKENS, H, device=CUDA, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="keyword"):
        graphed(x=_input(0))
    with pytest.raises(ConfigError, match="fp8_autocast"):
        with fp8state.fp8_autocast(enabled=False):
            graphed(_input(0))
    graphed(_input(0))  # still fine
    with fp8state.fp8_autocast():  # the graph's own settings: fine too
        graphed(_input(0))
    rows = graphed.fp8_meta("fwd").amax_history.shape[0]
    with pytest.warns(UserWarning, match="grow"):
        graphed.fp8_recipe = fp8state.DelayedScaling(amax_history_len=rows + 1)
    with pytest.raises(ConfigError, match="FP8 buffers replaced"):
        graphed(_input(0))
    other, _ = _pair(BUILD["Linear"])
    fp8state.make_graphed_callables(other, (_input(100),))
    other.weight = nn.Parameter(other.weight.detach().clone())
    with pytest.raises(ConfigError, match="parameters replaced"):
        other(_input(0))


def test_capture_inside_fp8_autocast_is_refused() -> None:
    graphed, _ = _pair(BUILD["Linear"])
    with fp8state.fp8_autocast(), pytest.raises(ConfigError, match="inside fp8_autocast"):
        fp8state.make_graphed_callables(graphed, (_input(100),))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 GEMMs (Ada or Hopper)",
)
def test_graphed_modules_run_fp8_from_the_graphed_threshold() -> None:
    # 2048 tokens x 2048 x 2048: below the eager default threshold, above the graphed one.
    eager, graphed = (fp8state.Linear(2048, 2048, **KW) for _ in range(2))
    x = torch.randn(2048, 2048, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    with fp8state.fp8_autocast():
        eager(x).float().sum().backward()
    assert eager.fp8_last_gemm_backend == "high_precision"
    assert not eager.fp8_graphed
    fp8state.make_graphed_callables(graphed, (x,))
    assert graphed.fp8_graphed
    graphed(x).float().sum().backward()
    assert graphed.fp8_last_gemm_backend == "scaled_mm"
    assert graphed.fp8_meta("fwd").amax_history[0, :2].gt(0).all()  # recorded by the replay


def test_gradients_accumulate_over_replays_as_over_eager_steps() -> None:
    # Autograd keeps a parameter's first gradient without copying it: it must not be the
    # graph's buffer, which the next replay rewrites.
    graphed, eager = _pair(BUILD["LayerNormMLP"])
    fp8state.make_graphed_callables(graphed, (_input(100),))
    for step in range(4):
        got = _step(graphed, _input(step), False, update=False)
        _assert_equal(got, _step(eager, _input(step), True, update=False), step)
        if step == 1:
            for model in (graphed, eager):
                _optimizer_step(model)


# A later micro-batch first (nothing cached yet: it casts), then three optimizer steps of
# three micro-batches each.
FLAGS = [[False, True, False], [True, False, False], [True, False, False]]


@pytest.mark.parametrize("kind", sorted(BUILD))
def test_weight_caching_replays_equal_eager_microbatches_bit_for_bit(kind: str) -> None:
    graphed, eager = _pair(BUILD[kind])
    fp8state.make_graphed_callables(graphed, (_input(100),), fp8_weight_caching=True)
    _assert_state_dicts_equal(graphed, eager)
    step = 0
    for flags in FLAGS:
        for first in flags:
            got = _step(graphed, _input(step), False, False, is_first_microbatch=first)
            want = _step(eager, _input(step), True, False, is_first_microbatch=first)
            _assert_equal(got, want, step)
            step += 1
        for model in (graphed, eager):
            _optimizer_step(model)
    # The later micro-batches reused the FP8 weights: the last one recorded no weight amax.
    fp8 = [m for m in graphed.modules() if isinstance(m, fp8state.FP8StateMixin)]
    assert fp8[0].fp8_meta("fwd").amax_history[0, 1] == 0
    assert fp8[0].fp8_meta("fwd").amax_history[2, 1] > 0  # the first micro-batch's did


def test_weight_caching_across_a_chain_and_a_checkpoint_load() -> None:
    def chain() -> nn.Sequential:
        return nn.Sequential(
            fp8state.LayerNormLinear(H, H, **KW), fp8state.LayerNormMLP(H, 2 * H, **KW)
        )

    graphed, eager = _pair(chain)
    samples = ((_input(100),), (_input(101),))
    fp8state.make_graphed_callables(tuple(graphed), samples, fp8_weight_caching=True)

    def run(model: nn.Sequential, x: torch.Tensor, eager_: bool, first: bool) -> torch.Tensor:
        for layer in model:
            if eager_:
                with fp8state.fp8_autocast():
                    x = layer(x, is_first_microbatch=first)
            else:
                x = layer(x, is_first_microbatch=first)
        return x

    buffer = io.BytesIO()
    for step, first in enumerate([True, False, False, True, False]):
        if step == 2:
            torch.save(graphed.state_dict(), buffer)
        if step == 4:  # back to the checkpoint: the load empties the caches, False casts
            for model in (graphed, eager):
                buffer.seek(0)
                model.load_state_dict(torch.load(buffer, weights_only=True))
        xs = (_input(step), _input(step))
        ys = [run(m, x, e, first) for m, x, e in ((graphed, xs[0], False), (eager, xs[1], True))]
        assert torch.equal(ys[0], ys[1]), step
        for y in ys:
            y.float().pow(2).mean().backward()
        assert torch.equal(xs[0].grad, xs[1].grad), step
        _assert_state_dicts_equal(graphed, eager)
        for model in (graphed, eager):
            _optimizer_step(model)


def test_weight_caching_refuses_what_it_cannot_follow() -> None:
    graphed, _ = _pair(BUILD["Linear"])
    fp8state.make_graphed_callables(graphed, (_input(100),), fp8_weight_caching=True)
    with pytest.raises(ConfigError, match="is_first_microbatch.*missing"):
        graphed(_input(0))
    graphed(_input(0), is_first_microbatch=True)
    with torch.no_grad():  # eager: caches a copy of its own, which the graphs cannot read
        graphed(_input(1), is_first_microbatch=True)
    with pytest.raises(ConfigError, match="is_first_microbatch=True to cast"):
        graphed(_input(2), is_first_microbatch=False)
    graphed(_input(2), is_first_microbatch=True).float().sum().backward()  # fine again
    plain, _ = _pair(BUILD["Linear"])
    fp8state.make_graphed_callables(plain, (_input(100),))
    with pytest.raises(ConfigError, match="without FP8 weight caching"):
        plain(_input(0), is_first_microbatch=True)


def test_a_second_call_in_flight_makes_the_first_backward_raise() -> None:
    graphed, eager = _pair(BUILD["Linear"])
    fp8state.make_graphed_callables(graphed, (_input(100),))
    y1 = graphed(_input(1))
    y2 = graphed(_input(2))  # replayed over the first call's saved state
    with pytest.raises(ConfigError, match="backward of forward call 1"):
        y1.float().sum().backward()
    y2.float().pow(2).mean().backward()  # the call in flight is still exact
    with fp8state.fp8_autocast():  # each graphed call has a context of its own
        eager(_input(1))  # the first call's forward, whose backward never ran
    with fp8state.fp8_autocast():
        y = eager(_input(2))
    y.float().pow(2).mean().backward()
    for p, q in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _LeavesDeadGraphs(nn.Module):
    """An FP8 Linear whose forward, while captured, leaves a dead reference cycle holding a
    CUDA graph (as any earlier graphed model that is gone may)."""

    def __init__(self, spare: torch.cuda.CUDAGraph) -> None:
        super().__init__()
        self.inner = fp8state.Linear(H, H, **KW)
        self.inner.fp8_min_gemm_macs = 0
        self.spare = [spare]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spare and torch.cuda.is_current_stream_capturing():
            cycle: list[object] = [self.spare.pop()]
            cycle.append(cycle)
        return self.inner(x)


def test_capture_holds_while_dead_graphs_wait_for_the_collector() -> None:
    # Freed mid-capture, a CUDA graph would fail the capture being made: the collector runs
    # before capturing and not during it, however eager it is set to run.
    spare, counter = torch.cuda.CUDAGraph(), torch.zeros(1, device=CUDA)
    with torch.cuda.graph(spare):
        counter.add_(1)
    module = _LeavesDeadGraphs(spare)
    del spare
    eager = fp8state.Linear(H, H, **KW)
    eager.fp8_min_gemm_macs = 0
    eager.load_state_dict(module.inner.state_dict())
    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # a collection at nearly every allocation
    try:
        fp8state.make_graphed_callables(module, (_input(100),))
    finally:
        gc.set_threshold(*thresholds)
    assert not module.spare  # dropped while a stream captured
    for step in range(3):
        got = _step(module, _input(step), False)
        want = _step(eager, _input(step), True)
        assert torch.equal(got["y"], want["y"]) and torch.equal(got["x.grad"], want["x.grad"])
        assert torch.equal(got["inner.weight.grad"], want["weight.grad"])
