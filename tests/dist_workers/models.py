"""Small models of fp8state modules for the checkpoint tests, and helpers to fill and read them.

Two kinds, built the same way on every rank from a seed:

- ``"mixin"``: modules defined here on :class:`fp8state.FP8StateMixin` (one with 1 GEMM, one
  with 2), so the tests do not depend on ``fp8state.Linear``;
- ``"te"``: ``fp8state.Linear`` and ``fp8state.LayerNormMLP`` (TE's names and state-dict keys).

FP8 metadata is given non-trivial, deterministic values with ``fp8_record_amax`` and
``fp8_update_scales`` (:func:`fill_fp8`), so a test can rebuild the expected state anywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fp8state

HIDDEN = 16
KINDS = ("mixin", "te")
#: History rows of the "mixin" kind: small, so tests can also load into other row counts.
MIXIN_ROWS = 16


class OneGemm(fp8state.FP8StateMixin):
    """A linear layer's parameters plus one GEMM's FP8 metadata (3 fwd, 2 bwd slots)."""

    def __init__(
        self, in_f: int, out_f: int, *, history_rows: int = MIXIN_ROWS, device: Any = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_f, in_f, device=device))
        self.bias = nn.Parameter(torch.empty(out_f, device=device))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.5)
            nn.init.normal_(self.bias, std=0.5)
        self.init_fp8_meta(num_gemms=1, history_rows=history_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class TwoGemm(fp8state.FP8StateMixin):
    """Two weights and two GEMMs' FP8 metadata (6 fwd, 4 bwd slots)."""

    def __init__(
        self, hidden: int, ffn: int, *, history_rows: int = MIXIN_ROWS, device: Any = None
    ) -> None:
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.empty(ffn, hidden, device=device))
        self.fc2_weight = nn.Parameter(torch.empty(hidden, ffn, device=device))
        if self.fc1_weight.device.type != "meta":
            nn.init.normal_(self.fc1_weight, std=0.5)
            nn.init.normal_(self.fc2_weight, std=0.5)
        self.init_fp8_meta(num_gemms=2, history_rows=history_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.fc1_weight.T) @ self.fc2_weight.T


class Net(nn.Module):
    """``inp`` (FP8, 1 GEMM) -> ``norm`` (plain LayerNorm) -> ``mlp`` (FP8) -> ``out`` (FP8)."""

    def __init__(
        self, kind: str = "mixin", *, device: Any = None, history_rows: int | None = None
    ) -> None:
        super().__init__()
        if kind == "mixin":
            rows = {"history_rows": history_rows or MIXIN_ROWS, "device": device}
            self.inp = OneGemm(8, HIDDEN, **rows)
            self.norm = nn.LayerNorm(HIDDEN, device=device)
            self.mlp = TwoGemm(HIDDEN, 2 * HIDDEN, **rows)
            self.out = OneGemm(HIDDEN, 8, **rows)
        elif kind == "te":
            self.inp = fp8state.Linear(8, HIDDEN, device=device)
            self.norm = nn.LayerNorm(HIDDEN, device=device)
            self.mlp = fp8state.LayerNormMLP(HIDDEN, 2 * HIDDEN, device=device)
            self.out = fp8state.Linear(HIDDEN, 8, device=device)
        else:
            raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(self.norm(self.inp(x))))


def build(
    kind: str = "mixin",
    *,
    seed: int | None = 0,
    device: Any = None,
    history_rows: int | None = None,
) -> Net:
    """The model of ``kind`` with weights drawn from ``seed`` (identical on every rank).

    ``seed=None`` leaves the generators alone: ``torch.manual_seed`` also seeds every CUDA
    device, which the device proof must not touch.
    """
    if seed is not None:
        torch.manual_seed(seed)
    return Net(kind, device=device, history_rows=history_rows)


def fp8_modules(model: nn.Module) -> dict[str, fp8state.FP8StateMixin]:
    """FP8 modules by name (wrapper prefixes such as DDP's ``module.`` removed)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, fp8state.FP8StateMixin):
            out[name.removeprefix("module.")] = module
    return out


@torch.no_grad()
def fill_fp8(model: nn.Module, salt: int, *, steps: int = 3) -> None:
    """Give every FP8 module deterministic, module- and salt-specific metadata."""
    for index, module in enumerate(fp8_modules(model).values()):
        device = module.fp8_meta("fwd").scale.device
        for step in range(steps):
            for direction in ("fwd", "bwd"):
                for slot in range(module.fp8_meta(direction).scale.numel()):
                    amax = 1.0 + 10.0 * salt + index + 0.25 * slot + 0.5 * step
                    module.fp8_record_amax(direction, slot, torch.tensor(amax, device=device))
                module.fp8_update_scales(direction)


def trained(kind: str = "mixin", seed: int | None = 1, salt: int = 1, **build_kw: Any) -> Net:
    """:func:`build` then :func:`fill_fp8`: the model of ``kind`` with metadata of ``salt``."""
    model = build(kind, seed=seed, **build_kw)
    fill_fp8(model, salt)
    return model


def full_state(model: nn.Module) -> dict[str, Any]:
    """Canonical-keyed state with every tensor whole and on the CPU (collective for FSDP2).

    FP8 extra state comes from ``get_extra_state`` (the schema payload), so two models compare
    equal only if their metadata is bit-identical.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for key, value in get_model_state_dict(model).items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu").clone()
        out[key] = value
    return out


def buffer_placement(model: nn.Module) -> dict[str, tuple[str, str]]:
    """``{module.buffer: (type name, device)}`` of every FP8 metadata buffer."""
    out = {}
    for name, module in fp8_modules(model).items():
        for direction in ("fwd", "bwd"):
            for field, buf in module.fp8_meta(direction)._asdict().items():
                out[f"{name}.fp8_{direction}_{field}"] = (type(buf).__name__, str(buf.device))
    return out
