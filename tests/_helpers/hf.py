"""A tiny Hugging Face Llama converted to FP8, built from a config (no downloads)."""

from __future__ import annotations

from typing import Any

import torch

import fp8state


def tiny_llama_config() -> Any:
    """Hidden 64, 2 layers, 4 heads over 2 KV heads, vocabulary 128, 32 positions."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
    )


def to_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """``convert_model``, with every FP8 module running FP8 even at this size."""
    fp8state.convert_model(model)
    for module in model.modules():
        if isinstance(module, fp8state.FP8StateMixin):
            module.fp8_min_gemm_macs = 0
    return model


def tiny_fp8_llama(seed: int = 0) -> torch.nn.Module:
    """A freshly initialized :func:`tiny_llama_config` model (``seed``), converted."""
    import transformers

    torch.manual_seed(seed)
    return to_fp8(transformers.LlamaForCausalLM(tiny_llama_config()))


def tiny_gpt2_config() -> Any:
    """Hidden 64, 2 layers, 2 heads, vocabulary 128, 32 positions; dropout left on."""
    import transformers

    return transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=2,
        vocab_size=128,
        n_positions=32,
        bos_token_id=0,  # GPT-2's 50256 is outside a 128-token vocabulary
        eos_token_id=0,
    )


def tiny_fp8_gpt2(seed: int = 0) -> torch.nn.Module:
    """A freshly initialized :func:`tiny_gpt2_config` model (``seed``), converted."""
    import transformers

    torch.manual_seed(seed)
    return to_fp8(transformers.GPT2LMHeadModel(tiny_gpt2_config()))


def tiny_fp8_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """``"llama"`` or ``"gpt2"``: the tiny converted model of that architecture."""
    return {"llama": tiny_fp8_llama, "gpt2": tiny_fp8_gpt2}[arch](seed)


def hf_class(arch: str) -> Any:
    """The ``transformers`` class :func:`tiny_fp8_model` builds for ``arch``."""
    import transformers

    return {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel}[arch]


def cpu_training_args(output_dir: str, **overrides: Any) -> Any:
    """``TrainingArguments`` for a deterministic CPU run, no reporting; ``overrides`` on top."""
    import transformers

    settings: dict[str, Any] = {
        "learning_rate": 1e-3,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "data_seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    return transformers.TrainingArguments(output_dir=output_dir, **{**settings, **overrides})
