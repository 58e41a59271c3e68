"""torch.compile of fp8state modules and steps: one graph, no recompilation, eager's numbers.

With ``backend="aot_eager"`` a compiled step runs the same kernels as an eager one, so outputs,
gradients and the whole state dict (FP8 metadata included) must match an eager twin bit for
bit, step after step, with ``fp8_autocast`` outside the compiled function or inside it. Dynamo
must trace each function in one frame (``fullgraph=True``) and compile it once: after the
first step, any recompilation is an error (``error_on_recompile``). Inductor's steps are
checked in tests/compile/test_compile_inductor.py, the GPU's in tests/gpu/test_compile_gpu.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch._dynamo.testing
from _helpers.compiling import aot_eager_keeping
from torch import nn

import fp8state
from fp8state.errors import ConfigError, RecomputationError

MODULES: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: fp8state.Linear(32, 48),
    "LayerNormLinear": lambda: fp8state.LayerNormLinear(32, 48),
    "LayerNormMLP": lambda: fp8state.LayerNormMLP(32, 64),
    "LayerNormMLP-swiglu": lambda: fp8state.LayerNormMLP(32, 64, activation="swiglu"),
    "Conv1D": lambda: fp8state.Conv1D(48, 32),
}
STEPS = 4
MARGIN_1 = fp8state.DelayedScaling(margin=1)  # recipes are built outside compiled functions


def _twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    module = make()
    return module, copy.deepcopy(module)


def _inputs(steps: int = STEPS, features: int = 32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 8, features, generator=gen) for _ in range(steps)]


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x.grad, y.grad)


def _compiled(fn: Callable) -> tuple[Callable, torch._dynamo.testing.CompileCounterWithBackend]:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, fullgraph=True, backend=counter), counter


def _outside(module: Callable, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        y = module(x)
    y.pow(2).sum().backward()
    return y


@pytest.mark.parametrize("name", sorted(MODULES))
def test_compiled_module_steps_equal_eager_steps(name: str) -> None:
    module, twin = _twins(MODULES[name])
    compiled, counter = _compiled(module)
    for step, x in enumerate(_inputs()):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            y = _outside(compiled, x)
        assert torch.equal(y, _outside(twin, x))
        _assert_same(module, twin)
    assert counter.frame_count == 1
    assert module.fp8_last_gemm_backend == "emulated"
    assert module.fp8_meta("bwd").amax_history[: STEPS + 1].count_nonzero() > 0


def _inside(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        return model(x).pow(2).sum()


def test_fp8_autocast_inside_the_compiled_step() -> None:
    model, twin = _twins(
        lambda: nn.Sequential(
            fp8state.LayerNormLinear(32, 48), fp8state.Linear(48, 32), fp8state.LayerNormMLP(32, 64)
        )
    )
    step, counter = _compiled(_inside)
    for i, x in enumerate(_inputs()):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss = step(model, x)
        loss.backward()
        want = _inside(twin, x)
        want.backward()
        assert torch.equal(loss, want)
        _assert_same(model, twin)
    assert counter.frame_count == 1
    assert not fp8state.autocast.is_fp8_enabled()  # the graph left the context it entered


def _nested(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        h = model[0](x)
        with fp8state.fp8_autocast(enabled=False):
            h = model[1](h)  # high precision, amaxes not recorded
        with fp8state.fp8_autocast(fp8_recipe=MARGIN_1):
            h = model[2](h)
    return h.pow(2).sum()


def test_nested_and_sequential_contexts_inside_the_compiled_step() -> None:
    make = lambda: nn.Sequential(  # noqa: E731
        fp8state.Linear(32, 32), fp8state.Linear(32, 32), fp8state.LayerNormLinear(32, 32)
    )
    model, twin = _twins(make)
    step, counter = _compiled(_nested)
    for i, x in enumerate(_inputs()):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss = step(model, x)
        loss.backward()
        _nested(twin, x).backward()
        _assert_same(model, twin)
    assert counter.frame_count == 1
    assert model[1].fp8_meta("fwd").amax_history.count_nonzero() == 0
    assert model[2].fp8_recipe.margin == 1


def test_micro_batches_and_shared_weights_record_as_eager() -> None:
    # Two forwards in one fp8_autocast (micro-batches: one step, max-combined amaxes), and a
    # module called twice in one graph.
    module, twin = _twins(lambda: fp8state.Linear(32, 32))
    compiled, counter = _compiled(lambda x: module(module(x)))
    for i, x in enumerate(_inputs()):
        for m, fn in ((module, compiled), (twin, lambda x: twin(twin(x)))):
            with torch._dynamo.config.patch(error_on_recompile=i > 0 and m is module):
                with fp8state.fp8_autocast():
                    fn(x).sum().backward()
                    fn(x * 2).sum().backward()
        _assert_same(module, twin)
    assert counter.frame_count == 1


def test_calibration_and_fallback_compile_as_eager() -> None:
    module, twin = _twins(lambda: fp8state.Linear(32, 32))
    compiled, _ = _compiled(module)
    for x in _inputs(2):
        for fn in (compiled, twin):
            with fp8state.fp8_autocast(enabled=False, calibrating=True):
                fn(x).sum().backward()
        _assert_same(module, twin)
    assert module.fp8_meta("fwd").amax_history[0].count_nonzero() == 2  # input and weight
    module.fp8_min_gemm_macs = twin.fp8_min_gemm_macs = 10**9  # too small for FP8
    torch._dynamo.reset()
    for fn in (torch.compile(module, fullgraph=True, backend="aot_eager"), twin):
        _outside(fn, _inputs(1)[0])
    assert module.fp8_last_gemm_backend == twin.fp8_last_gemm_backend == "high_precision"
    _assert_same(module, twin)


def test_a_compiled_fallback_adds_no_operator_and_notes_backends_in_order() -> None:
    # A GEMM too small for FP8 compiles to what F.linear compiles to: no fp8state operator
    # per call (each cost a compiled step host time). The backend each call ran with is
    # noted in program order, an FP8 call's and a fallback's alike.
    module, twin = _twins(lambda: fp8state.Linear(32, 32))
    module.fp8_min_gemm_macs = twin.fp8_min_gemm_macs = 10_000  # (2, 8, 32) in FP8, (1, 2, 32) not
    big, small = torch.randn(2, 8, 32), torch.randn(1, 2, 32)
    graphs: list[torch.fx.GraphModule] = []
    backend = aot_eager_keeping(graphs)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: (module(a), module(b)), fullgraph=True, backend=backend)
    for first, last, expected in ((big, small, "high_precision"), (small, big, "emulated")):
        for m, fn in ((module, compiled), (twin, lambda a, b: (twin(a), twin(b)))):
            with fp8state.fp8_autocast():
                fn(first, last)
            assert m.fp8_last_gemm_backend == expected
    small_only = torch.compile(module, fullgraph=True, backend=backend)
    with fp8state.fp8_autocast():
        small_only(small)
    assert module.fp8_last_gemm_backend == "high_precision"
    ops = [[str(n.target) for n in g.graph.nodes if "fp8state" in str(n.target)] for g in graphs]
    assert len(graphs) == 3 and ops[0] and ops[1]  # the FP8 calls' casts, GEMM and exit
    assert ops[2] == []


def test_a_checkpoint_saved_between_compiled_steps_resumes_exactly() -> None:
    module, twin = _twins(lambda: fp8state.LayerNormLinear(32, 48))
    compiled, _ = _compiled(module)
    xs = _inputs()
    for x in xs[:2]:
        _outside(compiled, x)
        _outside(twin, x)
    resumed = MODULES["LayerNormLinear"]()
    resumed.load_state_dict(copy.deepcopy(module.state_dict()))
    compiled_resumed = torch.compile(resumed, fullgraph=True, backend="aot_eager")
    for x in xs[2:]:
        for m in (module, resumed, twin):
            m.zero_grad()
        _outside(compiled, x)
        _outside(compiled_resumed, x)
        _outside(twin, x)
    _assert_same(resumed, twin)
    _assert_same(module, twin)


def test_outside_fp8_autocast_the_compiled_module_is_high_precision() -> None:
    module = fp8state.Linear(32, 32)
    compiled, _ = _compiled(module)
    x = _inputs(1)[0]
    _outside(compiled, x)
    out = compiled(x)
    assert torch.equal(out, nn.functional.linear(x, module.weight, module.bias))


def test_a_checkpoint_around_a_compiled_call_refuses_its_recomputation() -> None:
    module = fp8state.Linear(32, 32)
    # A compiled forward recomputed during backward (a checkpoint around the compiled call)
    # cannot replay its forward's scales: an error, not other numbers. (Recomputed outside
    # the fp8_autocast, the graph guards pick the high-precision graph, which torch's
    # checkpoint refuses itself.)
    torch._dynamo.reset()
    inner = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = _inputs(1)[0].requires_grad_()
    with fp8state.fp8_autocast():
        y = torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)
        with pytest.raises(RecomputationError, match="compiled FP8 forward run again"):
            y.sum().backward()


@pytest.mark.skipif(
    not hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"),
    reason="this torch has no such setting",
)
def test_a_checkpoint_traced_inside_the_graph_is_exact_or_refused() -> None:
    # Told to trace side effects inside a checkpoint anyway (Accelerate's regional compilation
    # with FSDP2 sets this), Dynamo compiles the checkpointed FP8 layer. torch 2.13's
    # AOTAutograd recomputes its casts in backward, where the forward's scales are gone: an
    # error. torch 2.11's keeps the casts' outputs instead: eager's numbers.
    module, twin = _twins(lambda: fp8state.Linear(32, 32))
    x = _inputs(1)[0].requires_grad_()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        compiled = torch.compile(
            lambda y: torch.utils.checkpoint.checkpoint(module, y, use_reentrant=False),
            fullgraph=True,
            backend="aot_eager",
        )
        with fp8state.fp8_autocast():
            out = compiled(x)
    try:
        out.pow(2).sum().backward()
    except RecomputationError as err:
        assert "compiled FP8 forward run again" in str(err)
        return
    y = x.detach().requires_grad_()
    assert torch.equal(out, _outside(twin, y))
    _assert_same(module, twin)
    assert torch.equal(x.grad, y.grad)


def test_compiled_forwards_accumulated_into_one_backward() -> None:
    # Several compiled forwards (and an evaluation forward) before one backward: eager's steps.
    module, twin = _twins(lambda: fp8state.LayerNormLinear(32, 32))
    compiled, counter = _compiled(module)
    for i, x in enumerate(_inputs()):
        for fn in (compiled, twin):
            with torch._dynamo.config.patch(error_on_recompile=i > 0 and fn is compiled):
                with fp8state.fp8_autocast():
                    loss = fn(x).sum() + fn(2 * x).sum()
                with torch.no_grad(), fp8state.fp8_autocast():
                    fn(x)
            loss.backward()
        _assert_same(module, twin)


def test_backwards_run_one_by_one_after_later_forwards() -> None:
    # Two forwards, then their backwards one by one: the second forward's exit updates the
    # forward scales, and the first backward's end the backward ones, before the second
    # backward runs; each backward must still use what its own forward cast with.
    module, twin = _twins(
        lambda: nn.Sequential(fp8state.LayerNormLinear(32, 32), fp8state.Linear(32, 32))
    )
    compiled, counter = _compiled(module)
    for i, x in enumerate(_inputs()):
        xs = [x, 3 * x]  # other amaxes: the second step's scales differ from the first's
        # _inside run eagerly: the context around the compiled module.
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            losses = [_inside(compiled, x) for x in xs]
        wants = [_inside(twin, x) for x in xs]
        for loss, want in zip(losses, wants, strict=True):
            loss.backward()
            want.backward()
            assert torch.equal(loss, want)
        _assert_same(module, twin)
    assert counter.frame_count == 1


SHARP = fp8state.DelayedScaling(margin=1)


def _two_recipes(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        y = module(x)
        with fp8state.fp8_autocast(fp8_recipe=SHARP):
            y = module(y)
    return y.pow(2).sum()


def test_each_call_backward_updates_under_its_own_forward_context() -> None:
    module, twin = _twins(lambda: fp8state.Linear(32, 32))
    step, _ = _compiled(_two_recipes)
    for x in _inputs(3):
        step(module, x).backward()
        _two_recipes(twin, x).backward()
        _assert_same(module, twin)
    assert module.fp8_recipe == twin.fp8_recipe


def test_a_graph_that_raises_leaves_no_context_entered() -> None:
    module = fp8state.Linear(32, 32)

    def bad_step(x: torch.Tensor) -> torch.Tensor:
        with fp8state.fp8_autocast():
            h = module(x)  # records, then the second call's backend is refused
            with fp8state.fp8_autocast(gemm_backend="scaled_mm"):
                return module(h)

    compiled, _ = _compiled(bad_step)
    with pytest.raises(ConfigError, match="scaled_mm"):
        compiled(_inputs(1)[0])
    assert not fp8state.autocast.is_fp8_enabled()
    before = module.fp8_meta("fwd").scale.clone()
    _outside(module, _inputs(1)[0])  # later steps update their scales again
    assert not torch.equal(module.fp8_meta("fwd").scale, before)


def test_compiled_modules_deep_copy_and_refuse_an_impossible_backend() -> None:
    module = fp8state.Linear(32, 32)
    compiled, _ = _compiled(module)
    _outside(compiled, _inputs(1)[0])
    copied = copy.deepcopy(module)
    assert torch.equal(copied.get_extra_state(), module.get_extra_state())
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    with pytest.raises(ConfigError, match="scaled_mm"):
        with fp8state.fp8_autocast(gemm_backend="scaled_mm"):
            compiled(_inputs(1)[0])


def test_alike_modules_share_one_graph() -> None:
    # Compiled block by block (as large models are): the module is a graph input, so
    # identical blocks share a graph instead of compiling one each up to Dynamo's limit.
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    blocks = [fp8state.LayerNormLinear(32, 32) for _ in range(10)]
    twins = copy.deepcopy(blocks)
    for block in blocks:
        block.compile(fullgraph=True, backend=counter)
    for step, x in enumerate(_inputs(2)):
        x.requires_grad_()  # as every block's input then: one graph fits all
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            _outside(nn.Sequential(*blocks), x)
        _outside(nn.Sequential(*twins), x)
    assert counter.frame_count == 1
    for block, twin in zip(blocks, twins, strict=True):
        _assert_same(block, twin)


def test_gemm_backend_notes_follow_the_calls_in_order() -> None:
    module, twin = _twins(lambda: fp8state.Linear(32, 32))
    module.fp8_min_gemm_macs = twin.fp8_min_gemm_macs = 32 * 32 * 16  # 16 tokens or more

    def two_sizes(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with fp8state.fp8_autocast():
            return m(x[:4]).sum() + m(x).sum()  # high precision, then FP8

    compiled, _ = _compiled(two_sizes)
    for x in _inputs(2):
        for m, fn in ((module, compiled), (twin, two_sizes)):
            fn(m, x.reshape(-1, 32)).backward()
        _assert_same(module, twin)
        assert module.fp8_last_gemm_backend == twin.fp8_last_gemm_backend == "emulated"


def _transposed_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        return m(x.transpose(0, 1)).float().pow(2).sum()


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_torch_autocast_around_a_compiled_step(name: str) -> None:
    # The emulated GEMM computes in float32 whatever torch.autocast says, in the graph's
    # operator as eagerly.
    module, twin = _twins(MODULES[name])
    step, _ = _compiled(_transposed_loss)
    for x in _inputs(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = step(module, x), _transposed_loss(twin, x)
        got.backward()
        want.backward()
        assert torch.equal(got, want)
        _assert_same(module, twin)


def test_a_graph_break_inside_a_compiled_context_makes_an_eager_step() -> None:
    # Dynamo cannot break a graph inside the context it traces: it runs the function holding
    # the `with` eagerly, the context enters and exits as eagerly, and the modules compiled
    # alone and the FP8 call run eagerly between them are an eager step's, bit for bit.
    module, twin = _twins(lambda: nn.Sequential(*(fp8state.Linear(32, 32) for _ in range(3))))

    def step(m: nn.Module, x: torch.Tensor, eager_part: Callable) -> torch.Tensor:
        with fp8state.fp8_autocast():
            return m[2](eager_part(m[1], m[0](x))).sum()

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter)
    eager_part = torch._dynamo.disable(lambda m, y: m(y))
    for x in _inputs(3):
        if not fp8state.autocast.BROKEN_CONTEXTS_RUN_EAGERLY:  # a torch without the setting
            with pytest.raises(ConfigError, match="graph break inside the context"):
                compiled(module, x, eager_part)
            return
        compiled(module, x, eager_part).backward()
        step(twin, x, lambda m, y: m(y)).backward()
        _assert_same(module, twin)
    assert module[2].fp8_meta("fwd").amax_history[:3, :2].gt(0).all()  # three steps recorded
    assert counter.frame_count == 2  # the two modules around the break, compiled alone
