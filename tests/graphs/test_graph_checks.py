"""make_graphed_callables' checks, on the CPU: what is refused before capture, and what a
replay would get wrong (shapes, replaced tensors, other FP8 settings) caught before replaying.
The captures and replays themselves run in tests/gpu/test_make_graphed_callables.py."""

from __future__ import annotations

import pytest
import torch
from _helpers.models import Gated

import fp8state
from fp8state.autocast import FP8Context
from fp8state.errors import ConfigError
from fp8state.graphs._capture import Captured, Graphs
from fp8state.graphs._checks import (
    ArgSpec,
    FP8Buffers,
    check_args,
    check_callables,
    check_context,
    microbatch_flag,
    weights_cached,
)
from fp8state.graphs._graphed import GraphedForward

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")


def _ctx(**kwargs) -> FP8Context:
    fields = {
        "enabled": True,
        "calibrating": False,
        "recipe": fp8state.DelayedScaling(),
        "group": None,
        "gemm_backend": "auto",
    }
    return FP8Context(**{**fields, **kwargs})


def test_only_modules_with_tensor_arguments_and_no_hooks_are_taken() -> None:
    layer = fp8state.Linear(16, 16)
    x = torch.randn(4, 16)
    with pytest.raises(ConfigError, match="callable 0.*function.*nn.Module"):
        check_callables((lambda t: t,), ((x,),))
    with pytest.raises(ConfigError, match="a tuple of tensors"):
        check_callables((layer,), ([x],))
    with pytest.raises(ConfigError, match="a tuple of tensors"):
        check_callables((layer,), ((x, 3),))
    with pytest.raises(ConfigError, match="2 argument tuples for 1 callables"):
        check_callables((layer,), ((x,), (x,)))
    hooked = fp8state.Linear(16, 16)
    hooked.register_forward_hook(lambda *a: None)
    with pytest.raises(ConfigError, match="hooks"):
        check_callables((hooked,), ((x,),))


def test_sample_kwargs_are_dicts_of_tensors_one_per_callable() -> None:
    layer = fp8state.Linear(16, 16)
    x = torch.randn(4, 16)
    for bad in ([x], {"gate": 2.0}, {1: x}):
        with pytest.raises(ConfigError, match="sample_kwargs.*a dict of keyword names"):
            check_callables((layer,), ((x,),), (bad,))
    with pytest.raises(ConfigError, match="2 argument dicts for 1 callables"):
        check_callables((layer,), ((x,),), ({}, {}))
    with pytest.raises(ConfigError, match="sample_kwargs.*a dict"):  # a tuple for one module
        fp8state.make_graphed_callables(layer, (x,), sample_kwargs=({"gate": x},))


@CPU_ONLY
def test_without_cuda_it_says_so_and_captures_nothing() -> None:
    layer = fp8state.Linear(16, 16)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ConfigError, match="no CUDA device"):
        fp8state.make_graphed_callables(layer, (torch.randn(4, 16),))
    assert "forward" not in layer.__dict__
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_bad_fp8_settings_are_refused_first() -> None:
    layer = fp8state.Linear(16, 16)
    x = torch.randn(4, 16)
    with pytest.raises(ConfigError, match="gemm_backend"):
        fp8state.make_graphed_callables(layer, (x,), gemm_backend="fast")
    with pytest.raises(ConfigError, match="fp8_recipe"):
        fp8state.make_graphed_callables(layer, (x,), fp8_recipe="E4M3")
    assert "forward" not in layer.__dict__


def test_sample_arguments_must_be_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the CUDA check, as on a GPU machine: CPU sample arguments are refused next.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    layer = fp8state.Linear(16, 16)
    with pytest.raises(ConfigError, match=r"sample_args\[0\].*a tensor on cpu"):
        fp8state.make_graphed_callables(layer, (torch.randn(4, 16),))
    with pytest.raises(ConfigError, match=r"sample_kwargs\['gate'\].*a tensor on cpu"):
        fp8state.make_graphed_callables(layer, (), sample_kwargs={"gate": torch.randn(4, 16)})


def test_replay_arguments_must_match_the_capture() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    spec = ArgSpec.of((x,))
    check_args(spec, (torch.randn(4, 16).requires_grad_(),), 0)
    with pytest.raises(ConfigError, match=r"argument 0.*shape \(8, 16\)"):
        check_args(spec, (torch.randn(8, 16).requires_grad_(),), 0)
    with pytest.raises(ConfigError, match="torch.float64"):
        check_args(spec, (torch.randn(4, 16, dtype=torch.float64).requires_grad_(),), 0)
    with pytest.raises(ConfigError, match="requires_grad=False"):
        check_args(spec, (torch.randn(4, 16),), 0)
    with pytest.raises(ConfigError, match="2 arguments"):
        check_args(spec, (x, x), 0)
    with pytest.raises(ConfigError, match="argument 0.*int"):
        check_args(spec, (3,), 0)


def test_replaced_parameters_and_buffers_are_caught_in_place_loads_are_not() -> None:
    layer = fp8state.Linear(16, 16)
    watch = FP8Buffers(layer, [layer])
    watch.check(0)
    layer.load_state_dict(fp8state.Linear(16, 16).state_dict())  # copies into the same tensors
    watch.check(0)
    with pytest.warns(UserWarning, match="grow"):
        layer.fp8_recipe = fp8state.DelayedScaling(amax_history_len=2048)
    with pytest.raises(ConfigError, match="FP8 buffers replaced"):
        watch.check(0)
    other = fp8state.Linear(16, 16)
    watch = FP8Buffers(other, [other])
    other.weight.data = other.weight.data.clone()  # what .to() does to a parameter
    with pytest.raises(ConfigError, match="parameters replaced"):
        watch.check(0)


def test_an_unrelated_buffer_replacement_elsewhere_is_not_an_error() -> None:
    layer = fp8state.Linear(16, 16)
    watch = FP8Buffers(layer, [layer])
    fp8state.Linear(16, 16)  # a new module bumps the process-wide replacement count
    watch.check(0)
    assert watch.generation > 0


def test_an_enclosing_autocast_must_ask_for_the_graphs_settings() -> None:
    captured = _ctx()
    check_context(captured, 0)  # none
    with fp8state.fp8_autocast():
        check_context(captured, 0)  # the same settings
    with fp8state.fp8_autocast(enabled=False), pytest.raises(ConfigError, match="enabled=False"):
        check_context(captured, 0)
    recipe = fp8state.DelayedScaling(margin=1)
    with fp8state.fp8_autocast(fp8_recipe=recipe), pytest.raises(ConfigError, match="margin=1"):
        check_context(captured, 0)


def _graphed_forward(
    layer: torch.nn.Module,
    x: torch.Tensor,
    kwargs: dict | None = None,
    caching: bool = False,
    **ctx,
) -> GraphedForward:
    # No graph is replayed on these paths, so none is needed (a CPU cannot capture one).
    kwargs = kwargs or {}
    inputs = (x, *kwargs.values())
    captured = Captured(None, None, inputs, tuple(layer.parameters()), (), None, (), ())  # type: ignore[arg-type]
    fp8 = [m for m in layer.modules() if isinstance(m, fp8state.FP8StateMixin)]
    graphs = Graphs(captured, captured if caching else None)
    return GraphedForward(0, layer, layer.forward, graphs, _ctx(**ctx), fp8, [], tuple(kwargs))


def test_outside_the_captured_mode_the_forward_runs_eagerly_under_the_graphs_settings() -> None:
    layer, twin = fp8state.Linear(16, 16), fp8state.Linear(16, 16)
    for m in (layer, twin):
        m.fp8_min_gemm_macs = 0
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(4, 16)
    graphed = _graphed_forward(layer, x, gemm_backend="emulated")
    with torch.no_grad():  # gradients off: no replay, the eager forward in FP8
        y = graphed(x)
        with fp8state.fp8_autocast(gemm_backend="emulated"):
            assert torch.equal(y, twin(x))
        with fp8state.fp8_autocast(enabled=False):  # the caller's settings win
            assert torch.equal(graphed(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer.fp8_last_gemm_backend == "emulated"
    assert torch.equal(layer.fp8_meta("fwd").scale, twin.fp8_meta("fwd").scale)
    layer.eval()  # another training mode than captured: eager, with gradients too
    y = graphed(x)
    with fp8state.fp8_autocast(gemm_backend="emulated"):
        assert torch.equal(y, twin(x))
    assert y.requires_grad


def test_keyword_arguments_are_checked_by_name_and_reach_the_eager_forward() -> None:
    block, twin = Gated(16), Gated(16)
    twin.load_state_dict(block.state_dict())
    for b in (block, twin):
        b.linear.fp8_min_gemm_macs = 0
    x, gate = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    graphed = _graphed_forward(block, x, {"gate": gate}, gemm_backend="emulated")
    with pytest.raises(ConfigError, match=r"keyword arguments \[\].*\['gate'\]"):
        graphed(x)
    with pytest.raises(ConfigError, match=r"keyword arguments \['bias'\]"):
        graphed(x, bias=gate)
    with pytest.raises(ConfigError, match=r"argument 'gate'.*shape \(1, 16\)"):
        graphed(x, gate=gate[:1])
    with torch.no_grad():  # no replay: the module's own forward, keyword included
        y = graphed(x, gate=gate)
        with fp8state.fp8_autocast(gemm_backend="emulated"):
            assert torch.equal(y, twin(x, gate=gate))


def test_in_the_captured_mode_wrong_calls_raise_before_any_replay() -> None:
    layer = fp8state.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    graphed = _graphed_forward(layer, x)
    with pytest.raises(ConfigError, match="keyword arguments"):
        graphed(inp=x)
    with pytest.raises(ConfigError, match="argument 0"):
        graphed(torch.randn(4, 16))
    with fp8state.fp8_autocast(enabled=False), pytest.raises(ConfigError, match="enabled=False"):
        graphed(x)
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    with pytest.raises(ConfigError, match="parameters replaced"):
        graphed(x)


def test_is_first_microbatch_is_required_with_weight_caching_and_refused_without() -> None:
    assert microbatch_flag({}, False, 0) is None
    assert microbatch_flag({"is_first_microbatch": None}, False, 0) is None  # every call casts
    with pytest.raises(ConfigError, match="callable 3, is_first_microbatch.*without FP8 weight"):
        microbatch_flag({"is_first_microbatch": True}, False, 3)
    for kwargs, found in (({}, "missing"), ({"is_first_microbatch": None}, "None"),
                          ({"is_first_microbatch": 1}, "1")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"{found}.*True or False.*fp8_weight_caching=True"):
            microbatch_flag(dict(kwargs), True, 0)
    kwargs = {"is_first_microbatch": False, "gate": torch.zeros(1)}
    assert microbatch_flag(kwargs, True, 0) is False
    assert list(kwargs) == ["gate"]  # taken out: the rest are the captured keyword tensors


def test_later_microbatches_reuse_the_graphs_weights_or_cast_where_there_are_none() -> None:
    layers = [fp8state.Linear(16, 16) for _ in range(2)]
    with fp8state.fp8_autocast():
        for layer in layers:
            layer(torch.randn(4, 16), is_first_microbatch=True)
    weights = tuple((layer, dict(layer.fp8_weight_cache)) for layer in layers)
    assert weights_cached(weights, 0)  # what the graphs' first micro-batch put there
    for layer in layers:
        layer.load_state_dict(layer.state_dict())  # a load empties the caches
    assert not weights_cached(weights, 0)  # a later micro-batch casts, as an eager one would
    layers[0].fp8_weight_cache.update(weights[0][1])
    with pytest.raises(ConfigError, match="callable 2.*emptied for some modules only"):
        weights_cached(weights, 2)  # one module's copies, the other's gone
    with fp8state.fp8_autocast():
        layers[1](torch.randn(4, 16), is_first_microbatch=True)  # an eager call's copies
    with pytest.raises(ConfigError, match="is_first_microbatch=True to cast"):
        weights_cached(weights, 0)
    assert weights_cached((), 0)  # nothing cached (no FP8 GEMM): nothing to miss


def test_with_weight_caching_calls_say_which_microbatch_and_eager_ones_obey() -> None:
    block, twin = Gated(16), Gated(16)  # its forward takes no is_first_microbatch
    twin.load_state_dict(block.state_dict())
    x, gate = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    graphed = _graphed_forward(block, x, {"gate": gate}, caching=True, gemm_backend="emulated")
    with pytest.raises(ConfigError, match="is_first_microbatch.*missing"):
        graphed(x, gate=gate)  # in the captured mode, before any replay
    for flag in (True, False, False):
        with torch.no_grad():  # no replay: the eager forward, as if its modules were given it
            got = graphed(x, gate=gate, is_first_microbatch=flag)
            with fp8state.fp8_autocast(gemm_backend="emulated"):
                want = twin.linear(x, is_first_microbatch=flag) * gate
            for model in (block, twin):
                model.linear.weight.mul_(2.0)  # the cached copies must not see it
        assert torch.equal(got, want), flag
        for a, b in zip(block.linear.fp8_meta("fwd"), twin.linear.fp8_meta("fwd"), strict=True):
            assert torch.equal(a, b)
    assert block.linear.fp8_weight_cache
