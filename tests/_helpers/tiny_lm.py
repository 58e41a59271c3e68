"""A plain-PyTorch model shared by the convert_model and plain-interop tests, and conversion
that fails on any warning.

``TinyLM`` is a small pre-LayerNorm transformer: an embedding tied to the output head, two
blocks (attention projections, an MLP in an ``nn.Sequential``), a final norm. Every GEMM size is
a multiple of 16, so convert_model converts all of it.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import fp8state
from _helpers.models import run_steps

HIDDEN, FFN, VOCAB = 32, 64, 48

#: The norm -> linear pairs of a TinyLM whose norm output feeds exactly that linear layer.
TINY_LM_PAIRS = [
    ("blocks.0.ln_1", "blocks.0.qkv"),
    ("blocks.0.ln_2", "blocks.0.mlp.0"),
    ("blocks.1.ln_1", "blocks.1.qkv"),
    ("blocks.1.ln_2", "blocks.1.mlp.0"),
]


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN, ffn: int = FFN) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2 and many HF models are

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    with torch.no_grad():  # LayerNorm starts at 1/0; make the norms' parameters matter
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    return model


def tokens(seed: int = 0, batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def convert_quietly(model: nn.Module, **kwargs: object) -> nn.Module:
    """``fp8state.convert_model(model, **kwargs)``, with any warning raised as an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        return fp8state.convert_model(model, **kwargs)  # type: ignore[arg-type]


def converted_tiny_lm(seed: int = 0, *, trained: bool = False) -> nn.Module:
    """A TinyLM through convert_model (its norm->linear pairs fused), trained a few steps if asked.

    Conversion must not warn (every GEMM of a TinyLM can run in FP8); training gives every
    module non-trivial FP8 metadata.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = fp8state.convert_model(tiny_lm(seed), layernorm_linear=TINY_LM_PAIRS)
    if trained:
        run_steps(model, 3, seed=seed)
    return model
