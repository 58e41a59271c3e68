"""Which state-dict layouts of FP8 metadata the tools handle natively (docs/decisions.md).

Three candidate layouts for a module's metadata, each on a toy module, through the tools users
save and load with. Prints one row per tool: ``ok`` or the exception it raised. CPU only, one
gloo rank for the DDP-wrapped ``set_model_state_dict`` case.

    python benchmarks/layout_probe.py
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

PAYLOAD = {"schema_version": torch.tensor(1), "fwd.scale": torch.ones(3)}


class DictExtraState(nn.Module):
    """Schema 1: ``_extra_state`` is a dict of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2))

    def get_extra_state(self):  # noqa: D102
        return {k: v.clone() for k, v in PAYLOAD.items()}

    def set_extra_state(self, state):  # noqa: D102
        assert set(state) == set(PAYLOAD)


class FlatKeys(nn.Module):
    """Flat keys ``<prefix>_extra_state.<key>`` written and read by the module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for k, v in PAYLOAD.items():
            destination[f"{prefix}_extra_state.{k}"] = v.clone()

    def _load_from_state_dict(self, sd, prefix, meta, strict, missing, unexpected, errors):
        keys = [f"{prefix}_extra_state.{k}" for k in PAYLOAD]
        missing.extend(k for k in keys if k not in sd)
        rest = {k: v for k, v in sd.items() if k not in keys}
        super()._load_from_state_dict(rest, prefix, meta, strict, missing, unexpected, errors)


class PackedTensor(nn.Module):
    """Schema 2: ``_extra_state`` is one float32 tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2))

    def get_extra_state(self):  # noqa: D102
        return torch.ones(4)

    def set_extra_state(self, state):  # noqa: D102
        assert isinstance(state, torch.Tensor) and state.shape == (4,)


def _tools():
    def safetensors_file(model):
        from safetensors.torch import load_file, save_file

        with tempfile.TemporaryDirectory() as d:
            save_file(model.state_dict(), f"{d}/m.safetensors")
            model.load_state_dict(load_file(f"{d}/m.safetensors"))

    def hf_shards(model):
        from huggingface_hub import split_torch_state_dict_into_shards

        split_torch_state_dict_into_shards(model.state_dict())

    def weights_only(model):
        with tempfile.TemporaryDirectory() as d:
            torch.save(model.state_dict(), f"{d}/m.pt")
            model.load_state_dict(torch.load(f"{d}/m.pt", weights_only=True))

    def dsd(model):
        set_model_state_dict(model, get_model_state_dict(model))

    def dsd_ddp(model):
        wrapped = nn.parallel.DistributedDataParallel(model)
        set_model_state_dict(wrapped, get_model_state_dict(wrapped))

    def strict_missing(model):
        sd = model.state_dict()
        sd = {k: v for k, v in sd.items() if "extra_state" not in k}
        result = model.load_state_dict(sd, strict=False)
        assert result.missing_keys, "no missing key reported"

    return {
        "safetensors save_file/load_file": safetensors_file,
        "huggingface_hub split_torch_state_dict_into_shards": hf_shards,
        "torch.save + torch.load(weights_only=True)": weights_only,
        "get/set_model_state_dict": dsd,
        "get/set_model_state_dict, DDP-wrapped": dsd_ddp,
        "load_state_dict reports a missing payload": strict_missing,
    }


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    layouts = {"dict (schema 1)": DictExtraState, "flat keys": FlatKeys, "packed": PackedTensor}
    print(f"| tool | {' | '.join(layouts)} |")
    print("| --- |" + " --- |" * len(layouts))
    for name, tool in _tools().items():
        cells = []
        for cls in layouts.values():
            try:
                tool(nn.Sequential(cls()))
                cells.append("ok")
            except Exception as err:  # noqa: BLE001 - the probe reports every failure
                cells.append(f"{type(err).__name__}: {str(err).splitlines()[0][:60]}")
        print(f"| {name} | {' | '.join(cells)} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
