"""PyTorch's own dcp.save/dcp.load, without fp8state's helpers: where the FP8 metadata lands
(docs/huggingface.md, "torch.distributed.checkpoint")."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from _helpers.state import assert_state_equal
from dist_workers import models


def _fresh() -> torch.nn.Module:
    return models.trained(seed=9, salt=9)  # other weights and metadata than the saved model


def test_loading_into_the_module_restores_metadata_too(tmp_path: Path) -> None:
    saved = models.trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process"
        dcp.save({"model": saved}, checkpoint_id=tmp_path)
        fresh = _fresh()
        dcp.load({"model": fresh}, checkpoint_id=tmp_path)  # Stateful: load_state_dict runs
    assert_state_equal(fresh, saved)


def test_loading_into_a_state_dict_needs_load_state_dict_after(tmp_path: Path) -> None:
    saved = models.trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved.state_dict(), checkpoint_id=tmp_path)
        fresh = _fresh()
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=tmp_path)
    # The weights were read in place; the metadata only into the dict's copies.
    assert torch.equal(fresh.inp.weight, saved.inp.weight)
    assert not torch.equal(fresh.inp.fp8_meta("fwd").scale, saved.inp.fp8_meta("fwd").scale)
    fresh.load_state_dict(sd)  # the one call that finishes it
    assert_state_equal(fresh, saved)
