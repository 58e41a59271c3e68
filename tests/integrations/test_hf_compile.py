"""A converted Hugging Face model compiled whole: one graph, eager's FP8 steps bit for bit.

A tiny ``transformers.LlamaForCausalLM`` (built from a config, nothing downloaded) converted
with ``fp8state.convert_model`` is compiled with ``fullgraph=True`` (``aot_eager``: the same
kernels as eager) and trained under ``fp8_autocast`` next to an eager twin: one frame, no
recompilation after the first step, and the same losses, gradients and state dicts (FP8
metadata included) at every step. Its ``generate()`` with the forward compiled gives eager's
tokens, every forward an FP8 step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
from _helpers.hf import tiny_fp8_llama
from _helpers.state import assert_same
from torch._dynamo.utils import counters

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


def test_compiled_llama_generates_as_eager() -> None:
    # generate() with the forward compiled and fp8_autocast entered inside it (autocast_forward):
    # a prefill and a decoding step per new token, each an FP8 step recording its amaxes.
    # transformers' attention rounds differently when compiled (a plain model's o_proj input
    # differs in the last bit of one decoding step), so the metadata is compared within bounds.
    new_tokens = 8
    model = tiny_fp8_llama(seed=0).eval()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    outputs = []
    for module, compiled in ((twin, False), (model, True)):
        wrapped = fp8state.autocast_forward(module)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            wrapped.forward = torch.compile(wrapped.forward, backend="aot_eager")
        settings = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
        outputs.append(wrapped.generate(ids, **settings))
    assert torch.equal(outputs[0], outputs[1])
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
    for (name, a), b in zip(model.named_modules(), twin.modules(), strict=True):
        if isinstance(a, fp8state.FP8StateMixin):
            history = a.fp8_meta("fwd").amax_history
            assert history[:new_tokens].amax(dim=1).gt(0).all(), name  # every forward recorded
            for x, y in zip(a.fp8_meta("fwd"), b.fp8_meta("fwd"), strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=0, msg=name)
