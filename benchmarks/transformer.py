"""The benchmarks' 16-layer transformer, from fp8state's modules, torch.nn's or floor layers.

Pre-norm layers of hidden 2048, ffn 8192 and 16 heads with SDPA attention (``MODEL``); per
layer a ``LayerNormLinear`` (qkv), a ``Linear`` (projection) and a ``LayerNormMLP`` (GELU),
against the same layers from ``torch.nn`` in bf16, or the least FP8 layers any
implementation could launch (``host_floor.FloorLinear``). ``training_loop.py`` times it;
``model_kernels.py``, ``profile_step.py`` and the probes take it from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from host_floor import FloorLinear  # benchmarks/ is on sys.path as a script
from torch import nn

import fp8state

MODEL = {"layers": 16, "hidden": 2048, "ffn": 8192, "heads": 16}


class Block(nn.Module):
    """One pre-norm transformer layer, from fp8state's modules or from torch.nn's.

    ``norm``: ``"LayerNorm"`` (the benchmarks' model) or ``"RMSNorm"`` (as Llama's layers).
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        heads: int,
        fp8: bool,
        device: torch.device,
        floor_tokens: int | None = None,
        norm: str = "LayerNorm",
    ):
        super().__init__()
        self.heads = heads
        kw = {"device": device, "dtype": torch.bfloat16}
        norm_cls = nn.RMSNorm if norm == "RMSNorm" else nn.LayerNorm
        if floor_tokens is not None:  # the least an FP8 layer can launch (host_floor)
            t = floor_tokens
            self.qkv = nn.Sequential(
                norm_cls(hidden, **kw),
                FloorLinear(t, hidden, 3 * hidden, fused_input=True, device=device),
            )
            self.proj = FloorLinear(t, hidden, hidden, device=device)
            self.mlp = nn.Sequential(  # GELU fused into the second GEMM's input cast
                norm_cls(hidden, **kw),
                FloorLinear(t, hidden, ffn, fused_input=True, device=device),
                FloorLinear(t, ffn, hidden, device=device),
            )
        elif fp8:
            pkw = {"device": device, "params_dtype": torch.bfloat16}
            nkw = {**pkw, "normalization": norm}
            self.qkv: nn.Module = fp8state.LayerNormLinear(hidden, 3 * hidden, **nkw)
            self.proj: nn.Module = fp8state.Linear(hidden, hidden, **pkw)
            self.mlp: nn.Module = fp8state.LayerNormMLP(hidden, ffn, **nkw)
        else:
            self.qkv = nn.Sequential(norm_cls(hidden, **kw), nn.Linear(hidden, 3 * hidden, **kw))
            self.proj = nn.Linear(hidden, hidden, **kw)
            self.mlp = nn.Sequential(
                norm_cls(hidden, **kw),
                nn.Linear(hidden, ffn, **kw),
                nn.GELU(approximate="tanh"),
                nn.Linear(ffn, hidden, **kw),
            )

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """The layer; ``is_first_microbatch`` goes to fp8state's modules where it is given."""
        kw = {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
        b, t, h = x.shape
        qkv = self.qkv(x, **kw).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, h), **kw)
        return x + self.mlp(x, **kw)


def build_model(
    fp8: bool,
    device: torch.device,
    floor_tokens: int | None = None,
    norm: str = "LayerNorm",
    **shape: int,
) -> nn.Module:
    """The model of fp8state's or torch.nn's layers, or of floor layers for ``floor_tokens``."""
    torch.manual_seed(0)
    dims = {**MODEL, **shape}
    blocks = [
        Block(dims["hidden"], dims["ffn"], dims["heads"], fp8, device, floor_tokens, norm)
        for _ in range(dims["layers"])
    ]
    return nn.Sequential(*blocks)


def mark_graphed(model: nn.Module, graphed: bool) -> None:
    """Set ``fp8_graphed`` on every FP8 module of ``model`` (the graphed FP8 threshold)."""
    for module in model.modules():
        if isinstance(module, fp8state.FP8StateMixin):
            module.fp8_graphed = graphed


def make_step(
    model: nn.Module,
    x: torch.Tensor,
    grad: torch.Tensor,
    fp8: bool,
    fresh_grads: bool = False,
    ahead: bool = False,
) -> Callable:
    """One fwd+bwd, the same for both models.

    Gradients accumulate from step to step (no optimizer), unless ``fresh_grads``: then each
    step first sets them to None (:func:`clear_grads`), and backward writes them instead of
    adding to them. ``ahead`` (FP8 only): the forward runs in a
    ``fp8state.cast_weights_ahead`` block, every weight cast before the first layer.
    """
    tokens = x.shape[:-1].numel()

    def step() -> None:
        if fresh_grads:
            clear_grads(model, x)
        if fp8 and ahead:
            with fp8state.fp8_autocast(), fp8state.cast_weights_ahead(model, tokens=tokens):
                y = model(x)
        elif fp8:
            with fp8state.fp8_autocast():
                y = model(x)
        else:
            y = model(x)
        y.backward(grad)

    return step


def clear_grads(model: nn.Module, x: torch.Tensor) -> None:
    """Set the gradients of ``model`` and of its input ``x`` to None.

    What ``zero_grad()`` does by default before each step of a training loop, and what torch's
    whole-network CUDA-graph capture does before capturing: the captured backward then writes
    fresh gradients into the graph's own memory on every replay, with no add.
    """
    model.zero_grad(set_to_none=True)
    x.grad = None
