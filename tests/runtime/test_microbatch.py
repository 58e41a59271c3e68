"""The micro-batch a call belongs to when it does not say: what graphs with FP8 weight caching
capture. Inside ``microbatch.assumed(flag)``, FP8 modules called without ``is_first_microbatch``
compute, cache and record exactly what they do when given ``flag``."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fp8state
from fp8state._runtime import microbatch
from fp8state.errors import ConfigError

H = 32


def _twins(build) -> tuple[nn.Module, nn.Module]:
    a, b = build(), build()
    b.load_state_dict(a.state_dict())
    return a, b


def _fp8(model: nn.Module) -> list[fp8state.FP8StateMixin]:
    return [m for m in model.modules() if isinstance(m, fp8state.FP8StateMixin)]


class _Block(nn.Module):
    """Calls its FP8 modules without ``is_first_microbatch``, as most user code does."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = fp8state.LayerNormLinear(H, H)
        self.mlp = fp8state.LayerNormMLP(H, 2 * H)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        kw = {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
        return self.mlp(self.qkv(x, **kw), **kw)


@pytest.mark.parametrize("flags", [(True, False, False), (False, True, False)])
def test_an_assumed_flag_acts_as_the_argument_would(seed: int, flags: tuple[bool, ...]) -> None:
    assumed, given = _twins(_Block)
    for step, flag in enumerate(flags):
        x = torch.randn(8, H) * (step + 1)
        with fp8state.fp8_autocast():
            with microbatch.assumed(flag):
                got = assumed(x)
            want = given(x, is_first_microbatch=flag)
        with torch.no_grad():  # a weight change the cached copies must not see
            for twin in (assumed, given):
                twin.mlp.fc1_weight.mul_(1.5)
        assert torch.equal(got, want), step
        for a, b in zip(_fp8(assumed), _fp8(given), strict=True):
            assert a.fp8_weight_cache.keys() == b.fp8_weight_cache.keys()
            for d in ("fwd", "bwd"):
                for ta, tb in zip(a.fp8_meta(d), b.fp8_meta(d), strict=True):
                    assert torch.equal(ta, tb), (step, d)
    # False reused the copy cast before the weight changed: the first micro-batch's numbers.
    assert assumed.mlp.fp8_weight_cache


def test_an_explicit_argument_wins_and_none_assumed_changes_nothing(seed: int) -> None:
    layer, twin = _twins(lambda: fp8state.Linear(H, H))
    x = torch.randn(8, H)
    with fp8state.fp8_autocast():
        layer(x, is_first_microbatch=True)
        twin(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(2.0)
            twin.weight.mul_(2.0)
        with microbatch.assumed(False):
            recast = layer(x, is_first_microbatch=True)  # the argument, not the assumption
        assert torch.equal(recast, twin(x, is_first_microbatch=True))
        with microbatch.assumed(None):
            plain = layer(x)
        assert torch.equal(plain, twin(x))


def test_the_assumption_is_this_threads_and_ends_with_its_block(seed: int) -> None:
    seen: list[bool | None] = []
    with pytest.raises(RuntimeError), microbatch.assumed(True):
        worker = threading.Thread(target=lambda: seen.append(microbatch.first_microbatch(None)))
        worker.start()
        worker.join()
        seen.append(microbatch.first_microbatch(None))
        raise RuntimeError("the block fails")
    assert seen == [None, True]
    assert microbatch.first_microbatch(None) is None
    assert microbatch.first_microbatch(False) is False


def test_a_compiled_call_refuses_an_assumed_flag(seed: int) -> None:
    # The flag a capture with weight caching assumes never reaches a compiled call: it would
    # cast where the graphs promise reuse, so it raises.
    layer = fp8state.Linear(H, H)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, H)
    with fp8state.fp8_autocast():
        compiled(x)  # without the assumption: fine
        with microbatch.assumed(False), pytest.raises(ConfigError, match="compiled FP8 call"):
            compiled(x)
