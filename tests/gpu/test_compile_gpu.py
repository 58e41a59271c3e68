"""Compiled FP8 training steps on a GPU: real FP8 GEMMs and Triton casts inside the graph.

CUDA only (the CPU suite covers the same paths with the emulation, tests/compile/). A model
of every fp8state module is trained for a few steps compiled (``fullgraph=True``) next to an
eager twin. With ``aot_eager`` the graph runs the eager kernels, so everything must match bit
for bit; Inductor fuses the norms around the FP8 GEMMs, so there the outputs and scales must
agree within bounds, the GEMMs must be ``torch._scaled_mm``'s, nothing may recompile after
the first step, and every step must record its amaxes and update its scales. A step whose
compiled ``fp8_autocast`` Dynamo breaks up is an eager step, bit for bit, and so are steps of
micro-batches that reuse cached FP8 weights.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch._inductor.config as inductor_config
from torch import nn

import fp8state
from fp8state._runtime import norm_cast
from tests._helpers.numerics import sqnr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    model = nn.Sequential(
        fp8state.LayerNormLinear(256, 768, **kw),
        fp8state.Linear(768, 256, **kw),
        fp8state.LayerNormMLP(256, 1024, **kw),
    )
    for module in model:
        module.fp8_min_gemm_macs = 0  # FP8 at this size too
    return model


def _train(model: nn.Module, forward, xs: list[torch.Tensor]) -> list:
    outs = []
    for x in xs:
        with fp8state.fp8_autocast():
            y = forward(x)
        # A sum: gradients large enough for E5M2 at the first step's scale of 1 (a mean's
        # underflow to zero, and the layers below then record an amax of 0).
        y.float().pow(2).sum().backward()
        outs.append(y.detach().clone())
    return outs


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return [
        torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(STEPS)
    ]


def _assert_bit_for_bit(compiled: nn.Module, eager: nn.Module) -> None:
    """State dicts (FP8 metadata included) and gradients equal; the GEMMs were FP8's."""
    pairs = zip(compiled.state_dict().items(), eager.state_dict().values(), strict=True)
    for (name, a), b in pairs:
        assert torch.equal(a, b), name
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert {m.fp8_last_gemm_backend for m in compiled} == {"scaled_mm"}


def _torch_norms(monkeypatch) -> None:
    """Eager calls compute their norms with torch's, as a graph does (docs/compile.md, Limits).

    Inside the cast, the norm's backward rounds the input gradient otherwise than torch's in
    bf16's last bits; the next gradient's FP8 cast usually absorbs that, but not always.
    """
    monkeypatch.setattr(norm_cast, "fusable", lambda *args: False)


def test_aot_eager_graph_matches_eager_bit_for_bit(monkeypatch) -> None:
    _torch_norms(monkeypatch)
    compiled, eager = _model(), _model()
    eager.load_state_dict(compiled.state_dict())
    eager[2].fp8_fuse_activation = False  # compiled as two GEMMs: so the eager twin too
    xs = _inputs()
    out_c = _train(compiled, torch.compile(compiled, fullgraph=True, backend="aot_eager"), xs)
    out_e = _train(eager, eager, xs)
    for a, b in zip(out_c, out_e, strict=True):
        assert torch.equal(a, b)
    _assert_bit_for_bit(compiled, eager)


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"])
def test_inductor_steps_agree_with_eager(mode: str | None) -> None:
    torch._dynamo.reset()
    compiled, eager = _model(), _model()
    eager.load_state_dict(compiled.state_dict())
    eager[2].fp8_fuse_activation = False
    xs = _inputs()
    forward = torch.compile(compiled, fullgraph=True, mode=mode)
    out_c = _train(compiled, forward, xs[:1])
    with torch._dynamo.config.patch(error_on_recompile=True):
        out_c += _train(compiled, forward, xs[1:])
    out_e = _train(eager, eager, xs)
    for a, b in zip(out_c, out_e, strict=True):
        assert sqnr(b, a) > 25
    for c, e in zip(compiled, eager, strict=True):
        for direction in ("fwd", "bwd"):
            got, want = c.fp8_meta(direction), e.fp8_meta(direction)
            # The history holds every step: a step whose bookkeeping was skipped shows here.
            assert torch.count_nonzero(got.amax_history[:STEPS].sum(1)) == STEPS
            torch.testing.assert_close(got.amax_history, want.amax_history, rtol=0.05, atol=0)
            torch.testing.assert_close(got.scale, want.scale, rtol=0.05, atol=0)
        assert c.fp8_last_gemm_backend == "scaled_mm"


def _loss_inside(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        return model(x).float().pow(2).sum()


def test_fp8_autocast_inside_the_compiled_step() -> None:
    torch._dynamo.reset()
    compiled, eager = _model(), _model()
    eager.load_state_dict(compiled.state_dict())
    eager[2].fp8_fuse_activation = False
    step = torch.compile(_loss_inside, fullgraph=True)
    for i, x in enumerate(_inputs()):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = step(compiled, x)
        got.backward()
        want = _loss_inside(eager, x)
        want.backward()
        assert sqnr(want, got) > 25
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(
            c.fp8_meta("fwd").scale, e.fp8_meta("fwd").scale, rtol=0.05, atol=0
        )
        assert torch.count_nonzero(c.fp8_meta("fwd").amax_history[:STEPS].sum(1)) == STEPS


def _broken_step(model: nn.Module, x: torch.Tensor, middle) -> torch.Tensor:
    with fp8state.fp8_autocast():
        return model[2](middle(model[1], model[0](x))).float().pow(2).sum()


def test_a_graph_break_inside_a_compiled_context_makes_an_eager_step(monkeypatch) -> None:
    # As on the CPU (tests/compile/): Dynamo runs the function holding the broken `with`
    # eagerly, the modules around the break compile alone, the middle one runs eagerly, and
    # with aot_eager every step is the eager step, bit for bit.
    if not fp8state.autocast.BROKEN_CONTEXTS_RUN_EAGERLY:
        pytest.skip("this torch cannot run fp8_autocast's frames eagerly")
    _torch_norms(monkeypatch)
    torch._dynamo.reset()
    compiled, eager = _model(), _model()
    eager.load_state_dict(compiled.state_dict())
    eager[2].fp8_fuse_activation = False  # compiled alone, it runs as two GEMMs
    step = torch.compile(_broken_step, backend="aot_eager")
    middle = torch._dynamo.disable(lambda m, y: m(y))
    for x in _inputs():
        step(compiled, x, middle).backward()
        _broken_step(eager, x, lambda m, y: m(y)).backward()
    _assert_bit_for_bit(compiled, eager)


def _micro_batch(model: nn.Module, x: torch.Tensor, first: bool) -> torch.Tensor:
    for module in model:
        x = module(x, is_first_microbatch=first)
    return x


def test_micro_batches_with_cached_weights_match_eager_bit_for_bit(monkeypatch) -> None:
    # As on the CPU (tests/compile/test_compile_microbatches.py): steps of two micro-batches,
    # the first casting the weights, the second reusing the modules' cached FP8 copies, an
    # SGD step between steps; two graphs (one per value of the argument). Without torch's
    # norms in the eager twin, its weights' gradients differed in the last bits here.
    _torch_norms(monkeypatch)
    torch._dynamo.reset()
    compiled, eager = _model(), _model()
    eager.load_state_dict(compiled.state_dict())
    eager[2].fp8_fuse_activation = False
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(_micro_batch, fullgraph=True, backend=counter)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (compiled, eager)]
    for i, x in enumerate(_inputs()[:4]):
        first = i % 2 == 0
        for model, run in ((compiled, step), (eager, _micro_batch)):
            with fp8state.fp8_autocast():
                y = run(model, x, first)
            y.float().pow(2).sum().backward()
        if not first:  # the end of a step: compare, then change the weights
            _assert_bit_for_bit(compiled, eager)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    assert all(module.fp8_weight_cache for module in compiled)
    assert counter.frame_count == 2
    for a, b in zip(compiled.state_dict().values(), eager.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_reduce_overhead_replays_its_cuda_graphs_and_agrees_with_eager(monkeypatch) -> None:
    # Inductor splits the graph around fp8state's operators into CUDA graphs. None may take
    # an FP8 operand (new memory every step) as a static input: torch would record it again
    # at every step (on an H200, 1115 against 59.6 ms per step for training_loop.py's model).
    from torch._inductor import cudagraph_trees  # private: imported where it is used

    recordings: list[object] = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counted(self, new_inputs, function_id):
        recordings.append(function_id)
        return record(self, new_inputs, function_id)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counted)
    torch._dynamo.reset()
    compiled, eager = _model(), _model()
    eager.load_state_dict(compiled.state_dict())
    eager[2].fp8_fuse_activation = False
    forward = torch.compile(compiled, fullgraph=True, mode="reduce-overhead")
    xs = _inputs() + _inputs()
    outs, settled = [], 0
    try:
        with inductor_config.patch(graph_partition=True):
            for i, x in enumerate(xs):
                torch.compiler.cudagraph_mark_step_begin()
                outs += _train(compiled, forward, [x])
                # Gradients accumulated across steps would read a CUDA graph's overwritten
                # output (bf16 fails so too): dropped after each step, as for the mode.
                compiled.zero_grad(set_to_none=True)
                if i == 2:
                    settled = len(recordings)
    finally:
        torch._dynamo.reset()  # Inductor's CUDA graph trees too: nothing left to later tests
    assert settled > 0  # the mode recorded CUDA graphs in its first steps
    assert len(recordings) == settled  # and replayed them ever after
    for a, b in zip(outs, _train(eager, eager, xs), strict=True):
        assert sqnr(b, a) > 25
    for c, e in zip(compiled, eager, strict=True):
        for direction in ("fwd", "bwd"):
            got, want = c.fp8_meta(direction), e.fp8_meta(direction)
            assert torch.count_nonzero(got.amax_history[: len(xs)].sum(1)) == len(xs)
            torch.testing.assert_close(got.scale, want.scale, rtol=0.05, atol=0)
