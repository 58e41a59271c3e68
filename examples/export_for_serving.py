"""Train a tiny Llama in FP8, then export it for serving as compressed-tensors FP8.

Run: ``python examples/export_for_serving.py OUT_DIR`` (CPU is fine; needs transformers and
safetensors). Then ``fp8state inspect OUT_DIR`` shows each FP8 layer and its scales, and
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` (with compressed-tensors
installed) or vLLM loads the folder as an FP8 model.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fp8state


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = fp8state.convert_model(LlamaForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        ids = torch.randint(0, 128, (2, 16))
        with fp8state.fp8_autocast():
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    report = fp8state.export_fp8(model, out_dir)
    print(
        f"wrote {out_dir}: {len(report.scales)} FP8 layers; in the training dtype: "
        f"{', '.join(report.ignored)}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama-fp8")
