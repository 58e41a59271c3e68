"""DCP across world sizes on CPU (gloo): N ranks save, M ranks load, DDP and FSDP2.

Four spawns in one module-scoped fixture (1, 2, 1 and 3 ranks; see tests/dist_workers/
dcp_worker.py) produce every record; the tests below check them against models rebuilt from
the same seeds. Each spawn has a deadline, so a hung collective fails instead of hanging.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers.state import assert_same
from dist_workers import dcp_worker, models
from dist_workers.launch import run_ranks, store_path

import fp8state.checkpoint as ckpt

pytestmark = pytest.mark.slow

KINDS = models.KINDS
_PHASES = (("save1", 1), ("w2", 2), ("w1load", 1), ("w3", 3))
_TIMEOUT_S = 120  # per spawn; each takes a few seconds on 2 cores


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every phase once; return ``{"work": folder, phase: [per-rank results]}``."""
    work = tmp_path_factory.mktemp("dcp")
    out: dict[str, Any] = {"work": work}
    for phase, world in _PHASES:
        if phase == "w2":  # the w2 ranks load the consolidated file of the 1-rank save
            for kind in KINDS:
                ckpt.consolidate(work / f"{kind}_fsdp_w1", work / f"{kind}_fsdp_w1.pt")
        run_ranks(
            dcp_worker.run,
            world,
            (world, store_path(str(work), phase), phase, str(work), KINDS),
            timeout=_TIMEOUT_S,
        )
        out[phase] = [
            torch.load(work / f"{phase}_rank{r}.pt", weights_only=True) for r in range(world)
        ]
        for per_kind in out[phase][0].values():  # a failed save fails every later test
            for name, record in per_kind.items():
                if name.startswith("save") and "error" in record:
                    raise AssertionError(f"{phase}: {name} failed:\n{record['traceback']}")
    return out


def _expected(kind: str, source: str) -> dict[str, Any]:
    seed, salt = dcp_worker.SAVED[source]
    return models.full_state(models.trained(kind, seed, salt))


def _check(record: dict[str, Any], kind: str, source: str) -> None:
    assert "error" not in record, record.get("traceback")
    assert_same(record["state"], _expected(kind, source))
    # FP8 metadata is never sharded: a plain tensor on the module's own (CPU) device.
    assert set(record["buffers"].values()) == {("Tensor", "cpu")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["fsdp_w1->fsdp2", "fsdp_w1->ddp2", "fsdp_w1->meta_fsdp2"])
def test_saved_on_1_rank_loads_on_2(dist_run: dict, kind: str, name: str) -> None:
    for rank_results in dist_run["w2"]:
        _check(rank_results[kind][name], kind, "fsdp_w1")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "name,source",
    [("ddp_w2->plain1", "ddp_w2"), ("fsdp_w2->plain1", "fsdp_w2"), ("fsdp_w2->fsdp1", "fsdp_w2")],
)
def test_saved_on_2_ranks_loads_on_1(dist_run: dict, kind: str, name: str, source: str) -> None:
    _check(dist_run["w1load"][0][kind][name], kind, source)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "name,source",
    [("fsdp_w2->fsdp3", "fsdp_w2"), ("ddp_w2->ddp3", "ddp_w2"), ("ddp_w2->fsdp3", "ddp_w2")],
)
def test_saved_on_2_ranks_loads_on_3(dist_run: dict, kind: str, name: str, source: str) -> None:
    for rank_results in dist_run["w3"]:
        _check(rank_results[kind][name], kind, source)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["consolidated_w1->fsdp2", "consolidated_w1->ddp2"])
def test_consolidated_file_loads_into_sharded_and_ddp_models(
    dist_run: dict, kind: str, name: str
) -> None:
    for rank_results in dist_run["w2"]:
        _check(rank_results[kind][name], kind, "fsdp_w1")


@pytest.mark.parametrize("kind", KINDS)
def test_differing_ranks_are_refused_before_anything_is_written(dist_run: dict, kind: str) -> None:
    for rank_results in dist_run["w2"]:
        result = rank_results[kind]["replicated_check"]
        assert "error" not in result, result.get("traceback")
        assert result["checked"] == 3  # identical ranks pass, all three modules compared
        assert result["raised"] == "DistributedStateError"
        assert result["written"] is False
        assert result["key"] == f"{dcp_worker.BAD_MODULE}._extra_state"
        assert "fwd.amax_history" in result["found"] and "fwd.scale" in result["found"]
        assert "ranks [0] vs ranks [1]" in result["found"]
        assert "bwd." not in result["found"]  # only the forward direction differs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["fsdp_w1", "ddp_w2", "fsdp_w2"])
def test_fresh_model_state_dict_has_the_saved_keys_and_shapes(
    dist_run: dict, kind: str, source: str
) -> None:
    stored = {e.key: e.shape for e in ckpt.read_dcp_metadata(dist_run["work"] / f"{kind}_{source}")}
    fresh = {}
    for key, value in models.build(kind, seed=0).state_dict().items():
        if isinstance(value, dict):  # DCP flattens the extra-state dict one level down
            fresh.update({f"{key}.{sub}": tuple(t.shape) for sub, t in value.items()})
        else:
            fresh[key] = tuple(value.shape)
    assert stored == fresh


@pytest.mark.parametrize("kind", KINDS)
def test_extra_state_is_stored_once_whole_and_weights_as_shards(dist_run: dict, kind: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(dist_run["work"] / f"{kind}_fsdp_w2")).read_metadata()
    chunks = {key: len(item.chunks) for key, item in md.state_dict_metadata.items()}
    extra = {k: n for k, n in chunks.items() if k.endswith("._extra_state")}
    weights = {k: n for k, n in chunks.items() if k.endswith("weight") and "norm" not in k}
    assert extra and set(extra.values()) == {1}  # replicated: one whole copy
    assert weights and set(weights.values()) == {2}  # sharded over the 2 saving ranks


@pytest.mark.parametrize("kind", KINDS)
def test_consolidated_two_rank_fsdp2_checkpoint_loads_with_plain_torch(
    dist_run: dict, kind: str, tmp_path: Path
) -> None:
    out = tmp_path / "model.pt"
    result = ckpt.consolidate(dist_run["work"] / f"{kind}_fsdp_w2", out)
    assert len(result.fp8_modules) == 3
    state = torch.load(out, weights_only=True)  # plain PyTorch, no fp8state involved
    assert all(isinstance(state[f"{m}._extra_state"], torch.Tensor) for m in ("inp", "mlp", "out"))
    model = models.build(kind, seed=5)
    model.load_state_dict(state, strict=True)
    assert_same(models.full_state(model), _expected(kind, "fsdp_w2"))
    assert os.listdir(tmp_path) == ["model.pt"]  # no temporary file left behind
