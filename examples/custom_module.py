"""A user-written FP8 module: two GEMMs on FP8StateMixin, trained, saved and reloaded.

Run: python examples/custom_module.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fp8state
from fp8state.functional import fp8_linear


class GatedProjection(fp8state.FP8StateMixin):
    """``down(silu(up(x)))``: two GEMMs, so 6 forward and 4 backward FP8 slots."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(inner, hidden) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(hidden, inner) / inner**0.5)
        self.init_fp8_meta(num_gemms=2)  # once, in __init__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(fp8_linear(self, x, self.up, gemm=0))
        return fp8_linear(self, h, self.down, gemm=1)


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(GatedProjection(32, 64), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(20):
        x = torch.randn(64, 32)
        with fp8state.fp8_autocast(fp8_recipe=fp8state.DelayedScaling(amax_history_len=8)):
            loss = (model(x).squeeze(-1) - x[:, 0]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    block = model[0]
    print(f"loss {loss.item():.4f}; forward scales {block.fp8_meta('fwd').scale.tolist()}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        torch.save(model.state_dict(), path)
        fresh = nn.Sequential(GatedProjection(32, 64), nn.Linear(32, 1))
        fresh.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(fresh[0].fp8_meta("fwd").scale, block.fp8_meta("fwd").scale)
    print("reloaded with torch.load(weights_only=True): FP8 metadata identical")


if __name__ == "__main__":
    main()
