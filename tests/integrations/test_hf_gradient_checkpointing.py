"""Hugging Face gradient checkpointing on a converted model: bit-identical FP8 training.

A tiny ``transformers.LlamaForCausalLM`` (built from a config, nothing downloaded) converted
with ``fp8state.convert_model`` trains a few steps under ``fp8_autocast`` with
``model.gradient_checkpointing_enable()`` (which runs ``torch.utils.checkpoint``, both ways)
and with fp8state's drop-in as the checkpoint function, eagerly and with the model compiled
whole (graph breaks allowed): losses, input and weight gradients and every FP8 buffer match
the same steps without checkpointing, bit for bit. On the CPU (emulated GEMMs) and, where
CUDA is present, in bf16 on the GPU (``torch._scaled_mm`` and the fused Triton casts on
FP8-capable GPUs).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import pytest
import torch
from _helpers.compiling import aot_eager_keeping
from _helpers.hf import tiny_fp8_llama, tiny_llama_config, to_fp8
from _helpers.state import assert_same

import fp8state
from fp8state.backends import resolve_backend
from fp8state.errors import ConfigError
from fp8state.functional import activation_checkpoint

transformers = pytest.importorskip("transformers")

STEPS = 3
FIELDS = ("amax_history", "scale", "scale_inv")


def _model(device: str) -> Any:
    if device == "cpu":
        model = tiny_fp8_llama(seed=0)
    else:  # bf16 on the GPU, with eager attention: its backward is deterministic
        torch.manual_seed(0)
        config = tiny_llama_config()
        config._attn_implementation = "eager"
        hf = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
        model = to_fp8(hf.to(device))
    fp8_modules = [m for m in model.modules() if isinstance(m, fp8state.FP8StateMixin)]
    assert len(fp8_modules) == 15  # 7 projections per layer, and the head
    return model.train()


def _enable(model: Any, how: str) -> None:
    if how == "none":
        return
    if how == "drop-in":
        # transformers' hook for the checkpoint function its layers call.
        model._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=activation_checkpoint
        )
        return
    with warnings.catch_warnings():  # renamed activation_checkpointing_enable in 5.x
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": how == "reentrant"}
        )
        assert model.is_gradient_checkpointing


def _train(
    how: str, device: str, graphs: list[torch.fx.GraphModule] | None = None, entry: str = "around"
) -> list[dict[str, torch.Tensor]]:
    """The steps' results; with ``graphs`` (which gets each graph), the model compiled
    whole with graph breaks allowed, ``aot_eager`` (eager's kernels). ``entry``: where
    ``fp8_autocast`` is entered: ``"around"`` each call, ``"wrapped"`` by ``autocast_forward``
    on the compiled model, ``"inside"`` by ``autocast_forward`` on the model then compiled."""
    model, seen = _model(device), []
    _enable(model, how)
    if entry == "inside":
        fp8state.autocast_forward(model)
    run = model
    if graphs is not None:
        torch._dynamo.reset()
        run = torch.compile(model, backend=aot_eager_keeping(graphs))
    if entry == "wrapped":
        run = fp8state.autocast_forward(run)
    backend = resolve_backend("auto", torch.device(device))
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (2, 16), generator=gen).to(device)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        with fp8state.fp8_autocast() if entry == "around" else contextlib.nullcontext():
            loss = run(inputs_embeds=embeds, labels=ids).loss
        loss.backward()
        step = {"loss": loss.detach(), "inputs_embeds.grad": embeds.grad}
        step.update({f"{n}.grad": p.grad for n, p in model.named_parameters()})
        for name, module in model.named_modules():
            if isinstance(module, fp8state.FP8StateMixin):
                assert module.fp8_last_gemm_backend == backend
                for d in ("fwd", "bwd"):
                    for field, t in zip(FIELDS, module.fp8_meta(d), strict=True):
                        step[f"{name}.{d}.{field}"] = t.clone()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:  # the embedding's: its output came in detached
                    p -= 0.01 * p.grad
                    p.grad = None
        seen.append(step)
    return seen


@functools.cache
def _reference(device: str) -> list[dict[str, torch.Tensor]]:
    return _train("none", device)


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "drop-in"])
def test_gradient_checkpointing_trains_bit_identically(how: str, device: torch.device) -> None:
    # On a GPU with FP8 tensor cores this is torch._scaled_mm and the fused Triton casts.
    assert_same(_reference(device.type), _train(how, device.type))


@pytest.mark.parametrize("entry", ["around", "wrapped", "inside"])
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "drop-in"])
def test_compiled_model_with_gradient_checkpointing_trains_bit_identically(
    how: str, entry: str, device: torch.device
) -> None:
    # torch.compile breaks the graph at each checkpointed layer (fp8state's bookkeeping, and
    # transformers' own, are side effects Dynamo refuses inside a checkpoint): those layers
    # run eagerly and replay their forwards exactly; the rest is compiled, the FP8 head too.
    # With the fp8_autocast entered inside the compiled model ("inside"), Dynamo runs the
    # wrapper holding it eagerly, and the context enters and exits as eagerly.
    if entry == "inside" and not fp8state.autocast.BROKEN_CONTEXTS_RUN_EAGERLY:
        with pytest.raises(ConfigError, match="graph break inside the context"):
            _train(how, device.type, [], entry)
        return
    graphs: list[torch.fx.GraphModule] = []
    assert_same(_reference(device.type), _train(how, device.type, graphs, entry))
    assert any("fp8state" in gm.code for gm in graphs)
