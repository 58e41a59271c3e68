"""DCP helpers in one process: dcp_save/dcp_load, consolidate, reading DCP folders, the CLI,
and the replicated-metadata comparison (its collective is covered by the multi-rank tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers.state import assert_same, fields
from dist_workers import models

import fp8state.checkpoint as ckpt
from fp8state.checkpoint import StateDictError, replicated
from fp8state.cli import main
from fp8state.errors import CheckpointError, DistributedStateError, SchemaVersionError

# Tests that write a checkpoint with raw dcp.save hear DCP assume a single process; so do we.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    source = models.trained(seed=7, salt=7)
    ckpt.dcp_save(source, tmp_path / "dcp")
    return tmp_path / "dcp", source


@pytest.mark.parametrize("kind", models.KINDS)
def test_save_and_load_without_a_process_group(tmp_path: Path, kind: str) -> None:
    source = models.trained(kind, seed=7, salt=7)
    ckpt.dcp_save(source, tmp_path / "dcp")
    model = models.trained(kind)
    result = ckpt.dcp_load(model, tmp_path / "dcp")
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_same(models.full_state(model), models.full_state(source))


def test_model_stored_under_a_key_next_to_other_state(tmp_path: Path) -> None:
    source = models.trained(seed=7, salt=7)
    ckpt.dcp_save(source, tmp_path / "dcp", key="model")
    assert all(e.path[0] == "model" for e in ckpt.read_dcp_metadata(tmp_path / "dcp"))
    model = models.trained()
    ckpt.dcp_load(model, tmp_path / "dcp", key="model")
    assert_same(models.full_state(model), models.full_state(source))
    with pytest.raises(StateDictError, match="no such key in the checkpoint") as info:
        ckpt.dcp_load(models.trained(), tmp_path / "dcp")  # the top level has no model keys
    extras = [p for p in info.value.problems if p.key.endswith("_extra_state")]
    assert extras and all("load_plain_state_dict" in p.fix for p in extras)
    assert not any("strict=False" in str(p) for p in extras)  # never the fix for metadata


@pytest.mark.parametrize("rows", [8, 32])
def test_history_of_another_length_loads_without_losing_rows(saved: tuple, rows: int) -> None:
    folder, source = saved  # saved with 16 rows
    model = models.build(seed=1, history_rows=rows)
    with pytest.warns(UserWarning, match="rows"):
        ckpt.dcp_load(model, folder)
    for name, module in models.fp8_modules(model).items():
        want = models.fp8_modules(source)[name].fp8_meta("fwd").amax_history
        got = module.fp8_meta("fwd").amax_history
        assert got.shape[0] == max(rows, 16)
        torch.testing.assert_close(got[:16], want, rtol=0, atol=0)
        assert not got[16:].any()


def test_keys_missing_from_the_checkpoint_fail_before_reading(saved: tuple) -> None:
    folder, source = saved
    model = models.trained()
    model.extra = torch.nn.Linear(2, 2)
    before = models.full_state(model)
    with pytest.raises(StateDictError) as info:
        ckpt.dcp_load(model, folder)
    assert [p.key for p in info.value.problems] == ["extra.weight", "extra.bias"]
    assert_same(models.full_state(model), before)
    result = ckpt.dcp_load(model, folder, strict=False)
    assert result.missing_keys == ["extra.weight", "extra.bias"]
    assert_same(
        {k: v for k, v in models.full_state(model).items() if not k.startswith("extra")},
        models.full_state(source),
    )


def test_invalid_metadata_in_the_checkpoint_leaves_the_model_unchanged(tmp_path: Path) -> None:
    state = models.trained(seed=7, salt=7).state_dict()
    fields(state["inp._extra_state"])["fwd.scale"][0] = -1.0  # in place
    state["out._extra_state"][0] = 3.0  # the packed header's version: from the future
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    model = models.trained()
    before = models.full_state(model)
    with pytest.raises(StateDictError) as info:
        ckpt.dcp_load(model, tmp_path / "dcp")
    assert [p.key for p in info.value.problems] == [
        "inp._extra_state['fwd.scale']",
        "out._extra_state['schema_version']",
    ]
    assert isinstance(info.value.problems[1], SchemaVersionError)
    assert_same(models.full_state(model), before)


def test_check_without_a_process_group_counts_and_passes() -> None:
    model = models.trained()
    assert ckpt.check_fp8_metadata_replicated(model) == 3
    assert ckpt.check_fp8_metadata_replicated({"model": model.state_dict()}) == 3


def _digests(**fields: str) -> dict[str, str]:
    base = {"fwd.scale": "a", "fwd.amax_history": "b", "bwd.scale": "c"}
    return {**base, **fields}


def test_compare_names_modules_fields_and_rank_groups() -> None:
    same = {"inp._extra_state": _digests(), "mlp._extra_state": _digests()}
    differs = {"inp._extra_state": _digests(), "mlp._extra_state": _digests(**{"bwd.scale": "x"})}
    problems = replicated._compare([same, differs, same], ranks=[0, 1, 2])
    assert len(problems) == 1
    assert isinstance(problems[0], DistributedStateError)
    assert problems[0].key == "mlp._extra_state"
    assert problems[0].found == "different bwd.scale on ranks [0, 2] vs ranks [1]"


def test_compare_only_among_ranks_that_hold_a_module() -> None:
    # Pipeline stages: each rank holds other modules; nothing is replicated, nothing differs.
    stage0, stage1 = {"a._extra_state": _digests()}, {"b._extra_state": _digests(**{"x": "y"})}
    assert replicated._compare([stage0, stage1], ranks=[4, 5]) == []
    problems = replicated._compare(
        [stage0, stage1, {"a._extra_state": _digests(x="1")}], ranks=[4, 5, 6]
    )
    assert [p.found for p in problems] == ["different x on ranks [4] vs ranks [6]"]


def test_digest_is_bit_exact() -> None:
    a = torch.tensor([1.0, 2.0])
    assert replicated._digest(a) == replicated._digest(a.clone())
    assert replicated._digest(a) != replicated._digest(torch.tensor([1.0, 2.0000002]))
    assert replicated._digest(a) != replicated._digest(a.double())
    assert replicated._digest(torch.tensor(3)) != replicated._digest(torch.tensor([3]))


# ----------------------------------------------------------------------------- consolidate


def test_consolidated_file_is_plain_pytorch(saved: tuple, tmp_path: Path) -> None:
    folder, source = saved
    out = tmp_path / "model.pt"
    result = ckpt.consolidate(folder, out)
    assert result.path == str(out)
    assert result.fp8_modules == ("inp._extra_state", "mlp._extra_state", "out._extra_state")
    state = torch.load(out, weights_only=True)
    assert sorted(state["mlp._extra_state"]) == sorted(source.mlp.get_extra_state())
    assert result.num_tensors == sum(len(v) if isinstance(v, dict) else 1 for v in state.values())
    model = models.trained()
    model.load_state_dict(state, strict=True)
    assert_same(models.full_state(model), models.full_state(source))


def test_consolidate_refuses_to_overwrite(saved: tuple, tmp_path: Path) -> None:
    folder, _ = saved
    out = tmp_path / "model.pt"
    out.write_bytes(b"keep me")
    with pytest.raises(CheckpointError, match="overwrite") as info:
        ckpt.consolidate(folder, out)
    assert "overwrite=True" in info.value.fix and "--overwrite" not in info.value.fix
    assert out.read_bytes() == b"keep me"
    ckpt.consolidate(folder, out, overwrite=True)
    assert "inp.weight" in torch.load(out, weights_only=True)


def test_consolidate_validates_before_writing(tmp_path: Path) -> None:
    state = models.trained().state_dict()
    fields(state["mlp._extra_state"])["bwd.amax_history"][0, 0] = float("inf")  # in place
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    with pytest.raises(StateDictError) as info:
        ckpt.consolidate(tmp_path / "dcp", tmp_path / "out.pt")
    assert [p.key for p in info.value.problems] == ["mlp._extra_state['bwd.amax_history']"]
    assert sorted(os.listdir(tmp_path)) == ["dcp"]


def test_consolidate_rejects_what_is_not_a_dcp_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=".metadata"):
        ckpt.consolidate(tmp_path / "empty", tmp_path / "out.pt")
    with pytest.raises(FileNotFoundError):
        ckpt.consolidate(tmp_path / "nope", tmp_path / "out.pt")


def test_damaged_shard_is_a_checkpoint_error(saved: tuple, tmp_path: Path) -> None:
    folder, _ = saved
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="missing or damaged"):
        ckpt.consolidate(folder, tmp_path / "out.pt")


def test_cli_consolidate(saved: tuple, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder, _ = saved
    out = tmp_path / "cli.pt"
    assert main(["consolidate", str(folder), str(out)]) == 0
    assert "3 FP8 module(s) validated" in capsys.readouterr().out
    assert main(["consolidate", str(folder), str(out)]) == 1  # exists, no --overwrite
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    assert main(["consolidate", str(folder), str(out), "--overwrite"]) == 0
    assert main(["consolidate", str(tmp_path / "nope"), str(out)]) == 1


# ------------------------------------------------------------------------- reading folders


def test_read_metadata_lists_items_without_reading_data(saved: tuple) -> None:
    folder, source = saved
    entries = {e.key: e for e in ckpt.read_dcp_metadata(folder)}
    payload = entries["mlp._extra_state"]
    assert payload.path == ("mlp._extra_state",)
    assert payload.shape == source.mlp.get_extra_state().shape and payload.dtype == torch.float32
    assert entries["inp.weight"].shape == tuple(source.inp.weight.shape)
    assert ckpt.is_dcp_checkpoint(folder) and not ckpt.is_dcp_checkpoint(folder / ".metadata")


def test_load_dcp_state_dict_whole_or_some_keys(saved: tuple) -> None:
    folder, source = saved
    whole = ckpt.load_dcp_state_dict(folder)
    assert_same({k: v for k, v in whole.items()}, models.full_state(source))
    some = ckpt.load_dcp_state_dict(folder, keys={"mlp._extra_state"})
    assert list(some) == ["mlp._extra_state"]
    assert sorted(some["mlp._extra_state"]) == sorted(whole["mlp._extra_state"])


def test_load_dcp_state_dict_falls_back_to_the_public_converter(
    saved: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fp8state.checkpoint import dcp_files

    def gone(*args: object) -> None:
        raise ImportError("private planner removed in this torch")

    monkeypatch.setattr(dcp_files, "_load_with_empty_planner", gone)
    folder, source = saved
    assert_same(ckpt.load_dcp_state_dict(folder, trusted=True), models.full_state(source))
    with pytest.raises(ImportError):
        ckpt.load_dcp_state_dict(folder, keys={"inp.weight"}, trusted=True)


def test_docstring_examples_run() -> None:
    import doctest
    import warnings

    from fp8state.checkpoint import consolidation, dcp_files, distributed, io, validate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process" in examples
        for module in (consolidation, dcp_files, distributed, io, validate):
            result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
            assert result.failed == 0 and result.attempted > 0, module.__name__
