"""Hugging Face ``Trainer`` on two gloo ranks whose padded batches differ in length.

With the FP8 threshold between the ranks' token counts, the attention projections run in FP8
on one rank and fall back on the other. Training runs through, and both ranks end with the
same weights and the same FP8 metadata, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers.state import assert_same
from dist_workers.launch import free_port, run_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_ranks_with_other_batch_lengths_keep_one_fp8_state(tmp_path) -> None:
    from dist_workers.hf_trainer_worker import STEPS, run

    run_ranks(run, 2, (2, free_port(), str(tmp_path)), timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    q, mlp = "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.up_proj"
    assert ranks[0]["backends"][q] == "emulated"
    assert ranks[1]["backends"][q] == "high_precision"
    assert ranks[0]["backends"][mlp] == ranks[1]["backends"][mlp] == "emulated"
    for r in ranks:
        assert len(r["losses"]) == STEPS and all(math.isfinite(x) for x in r["losses"])
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own batches
    assert_same(ranks[1]["payloads"], ranks[0]["payloads"])
    assert_same(ranks[1]["weights"], ranks[0]["weights"])
    history = ranks[0]["payloads"][q]["fwd.amax_history"]
    assert history[:STEPS, 0].all()  # rank 0's input amaxes, reduced into both ranks' rows
