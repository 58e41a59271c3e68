"""A converted Hugging Face model compiled whole: one graph, eager's FP8 steps bit for bit.

A tiny ``transformers.LlamaForCausalLM`` (built from a config, nothing downloaded) converted
with ``fp8state.convert_model`` is compiled with ``fullgraph=True`` (``aot_eager``: the same
kernels as eager) and trained under ``fp8_autocast`` next to an eager twin: one frame, no
recompilation after the first step, and the same losses, gradients and state dicts (FP8
metadata included) at every step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
from _helpers.hf import tiny_fp8_llama
from _helpers.state import assert_same

import fp8state

pytest.importorskip("transformers")


def test_compiled_llama_trains_as_eager() -> None:
    torch._dynamo.reset()
    model = tiny_fp8_llama(seed=0).train()
    twin = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        losses = []
        for forward in (compiled, twin):
            with torch._dynamo.config.patch(error_on_recompile=step > 0 and forward is compiled):
                with fp8state.fp8_autocast():
                    loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1])
        assert_same(model.state_dict(), twin.state_dict())
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    assert counter.frame_count == 1
    fp8_modules = [m for m in model.modules() if isinstance(m, fp8state.FP8StateMixin)]
    assert {m.fp8_last_gemm_backend for m in fp8_modules} == {"emulated"}
