"""One rank of Hugging Face ``Trainer`` data-parallel training whose batches differ in length.

Each rank pads its batches to their own longest row, as a padding collator does, and rank 0's
rows are longer than rank 1's: 24-32 tokens a batch against 8-12. With the FP8 threshold
between them, rank 0 runs the attention projections in FP8 and rank 1 falls back there,
while both run the MLP in FP8. Each rank writes what the test compares to
``OUT/rank<r>.pt``. Used by tests/integrations/test_hf_trainer_distributed.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from _helpers.hf import cpu_training_args, tiny_fp8_model
from _helpers.state import fp8_payloads

import fp8state
from dist_workers.launch import shutdown

#: Rows a batch, optimizer steps, and the FP8 threshold: 2 x 12 tokens x 64 x 64 (q_proj on
#: rank 1) < THRESHOLD <= 2 x 12 x 64 x 64 x 2 (q_proj on rank 0, the MLP on both).
BATCH, STEPS, THRESHOLD = 2, 4, 65536
LENGTHS = ((12, 16), (4, 6))  # the shortest and longest row of each rank


def _dataset(rank: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    low, high = LENGTHS[rank]
    rows = []
    for _ in range(BATCH * STEPS):
        length = int(torch.randint(low, high + 1, (), generator=gen))
        rows.append({"input_ids": torch.randint(1, 128, (length,), generator=gen)})
    return rows


def _pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest row; padding is masked out and ignored by the loss."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = row["input_ids"]
        mask[i, : len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        # A function of its own: the DDP model must be freed before its process group is
        # destroyed (dist_workers.launch.shutdown says why).
        torch.save(_train(rank, out), Path(out) / f"rank{rank}.pt")
    finally:
        shutdown()


def _train(rank: int, out: str) -> dict:
    model = fp8state.autocast_forward(tiny_fp8_model("llama", seed=0))
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, fp8state.FP8StateMixin)}
    for module in fp8.values():
        module.fp8_min_gemm_macs = THRESHOLD
    losses: list[float] = []
    model.register_forward_hook(lambda _m, _a, output: losses.append(float(output.loss)))
    args = cpu_training_args(
        str(Path(out) / "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        save_strategy="no",
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_dataset(rank), data_collator=_pad
    )
    trainer.train()
    return {
        "world": torch.distributed.get_world_size(),
        "losses": losses,
        "backends": {name: m.fp8_last_gemm_backend for name, m in fp8.items()},
        "payloads": fp8_payloads(model),
        "weights": {
            k: v.detach().clone() for k, v in model.state_dict().items() if "extra" not in k
        },
    }
