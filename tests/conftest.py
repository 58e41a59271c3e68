"""Shared fixtures: a fixed seed, and a ``device`` parameter (CPU always, CUDA when present).

Markers (declared in pyproject.toml, ``--strict-markers``): ``gpu`` tests are skipped without a
CUDA device, with the reason; ``slow`` marks multi-process or long-running tests.
"""

from __future__ import annotations

import pytest
import torch

SEED = 1234

_CUDA = torch.cuda.is_available()
_NO_CUDA_REASON = "needs a CUDA device; torch.cuda.is_available() is False"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _CUDA:
        return
    skip = pytest.mark.skip(reason=_NO_CUDA_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """Seed torch's global generator and return the seed (use it for local generators too)."""
    torch.manual_seed(SEED)
    return SEED


@pytest.fixture(
    params=[
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    ]
)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every device a test should run on: CPU always, CUDA where available (else skipped)."""
    return torch.device(request.param)
