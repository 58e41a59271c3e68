"""Read a real TransformerEngine checkpoint without TransformerEngine, convert it, train on.

Run: python examples/convert_te_checkpoint.py

The file, ``examples/data/te2.20_linear_bias_default.pt``, was written by TE 2.20.2 on an
H200: ``torch.save(model.state_dict())`` of ``{"proj": te.Linear(64, 32)}`` after three FP8
steps. Its ``_extra_state`` is a uint8 tensor of pickled TE objects and its weights are tagged
``cuda:0``. Here it is inspected, migrated (no TE import, no pickled code runs, nothing touches
a GPU), loaded into ``fp8state.Linear`` and trained one more FP8 step, on a CPU.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import fp8state
from fp8state.errors import LegacyFormatError
from fp8state.migrate import migrate_te_checkpoint
from fp8state.migrate.summary import summarize_checkpoint

TE_FILE = Path(__file__).resolve().parent / "data" / "te2.20_linear_bias_default.pt"


def main(te_path: Path = TE_FILE) -> int:
    # 1. What is in it? (`fp8state inspect FILE` prints the same table.)
    print(summarize_checkpoint(te_path).format_table())

    # 2. fp8state's safe loader refuses TE's pickled extra state, and says what to do.
    try:
        fp8state.checkpoint.load(te_path)
    except LegacyFormatError as err:
        print(f"\nfp8state.checkpoint.load refuses it: {err.found}")

    # 3. Convert (`fp8state migrate IN OUT` does the same and writes OUT atomically).
    converted, report = migrate_te_checkpoint(te_path)
    print("\n" + report.format_text())

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fp8state_model.pt"
        torch.save(converted, out)
        # The converted file holds tensors only: plain torch.load(weights_only=True) reads it.
        state_dict = torch.load(out, weights_only=True)

    # 4. Load into the matching fp8state module; TE's names are fp8state's names.
    model = nn.ModuleDict({"proj": fp8state.Linear(64, 32)})
    model.load_state_dict(state_dict)  # strict: every key matched
    proj = model["proj"]
    recipe = proj.fp8_recipe  # the recipe TE trained with, read from the checkpoint
    print(
        f"\nrecipe from the checkpoint: {recipe.fp8_format.name}, margin {recipe.margin}, "
        f"amax_history_len {recipe.amax_history_len}, {recipe.amax_compute_algo}"
    )
    for direction in ("fwd", "bwd"):
        meta = proj.fp8_meta(direction)
        print(f"proj {direction}.scale {meta.scale.tolist()}")
        # Check with plain torch: each recorded slot's scale is fp8_max / amax / 2**margin,
        # the amax being the max over the recipe's window of the history TE saved.
        amax = meta.amax_history[: recipe.amax_history_len].amax(dim=0)
        fp8_max = torch.tensor(recipe.fp8_format.max(direction))
        expected = fp8_max / amax[amax > 0] / 2**recipe.margin
        if not torch.equal(meta.scale[amax > 0], expected):
            print(f"{direction} scales do not match the saved history", file=sys.stderr)
            return 1
    if not torch.equal(proj.weight, converted["proj.weight"]):
        print("weights changed in conversion", file=sys.stderr)
        return 1

    # 5. Train on, in FP8, with TE's recipe: the delayed scales continue from TE's history.
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = proj.fp8_meta("fwd").amax_history[0].clone()
    with fp8state.fp8_autocast(fp8_recipe=recipe):
        loss = proj(torch.randn(16, 64)).square().mean()
    loss.backward()
    opt.step()
    history = proj.fp8_meta("fwd").amax_history
    if not torch.equal(history[1], before):  # TE's newest row moved down one step
        print("the history did not continue from TE's", file=sys.stderr)
        return 1
    print(
        f"one FP8 step on {proj.weight.device}: loss {loss.item():.4f}; TE's amax history "
        "continues (its newest row is now row 1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
