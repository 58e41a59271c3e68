"""A graph of FP8 casts compiled for Inductor's partitioned CUDA graphs warns once traced.

fp8state's operators stay outside CUDA graphs (their Python runs every step), and torch
records the CUDA graphs between them again at every step under ``mode="reduce-overhead"``
(docs/compile.md): far slower than the default mode, with no error to show it. The warning
is decided from Inductor's settings while it traces the casts of a CUDA graph; on the CPU
there are no CUDA graphs, so compiling there in that mode must stay silent.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._inductor.config as inductor_config

import fp8state
import fp8state.functional._ops as fp8_ops
from fp8state.functional._ops import warn_if_recorded_every_step

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it


def _warnings(device: torch.device, **settings: bool) -> list[str]:
    with inductor_config.patch(settings), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_recorded_every_step(device)
    return [str(w.message) for w in caught]


def test_partitioned_cuda_graphs_of_cuda_casts_warn() -> None:
    (message,) = _warnings(CUDA, **{"triton.cudagraphs": True, "graph_partition": True})
    assert "reduce-overhead" in message and "max-autotune" in message
    assert "make_graphed_callables" in message and "graph_partition = False" in message


@pytest.mark.parametrize(
    ("device", "cudagraphs", "partition"),
    [
        (CUDA, False, True),  # the default mode: no CUDA graphs
        (CUDA, True, False),  # no partitions: Inductor runs the graph without CUDA graphs
        (torch.device("cpu"), True, True),  # CPU graphs get no CUDA graphs
    ],
)
def test_no_warning_without_partitioned_cuda_graphs(
    device: torch.device, cudagraphs: bool, partition: bool
) -> None:
    settings = {"triton.cudagraphs": cudagraphs, "graph_partition": partition}
    assert _warnings(device, **settings) == []


def test_the_casts_trace_asks_under_the_compiling_modes_settings(monkeypatch) -> None:
    # The decision reads Inductor's settings, which the mode sets only while Inductor traces:
    # the casts' trace must ask there, with the device of what it casts.
    asked: list[tuple[str, bool]] = []

    def spy(device: torch.device) -> None:
        asked.append((device.type, bool(inductor_config.triton.cudagraphs)))

    monkeypatch.setattr(fp8_ops, "warn_if_recorded_every_step", spy)
    for mode, cudagraphs in (("default", False), ("reduce-overhead", True)):
        torch._dynamo.reset()
        asked.clear()
        layer = fp8state.Linear(32, 32)
        with fp8state.fp8_autocast():
            torch.compile(layer, mode=mode, fullgraph=True)(torch.randn(16, 32)).sum().backward()
        assert asked, mode
        assert ("cpu", True) in asked if cudagraphs else all(not flag for _, flag in asked)


def test_compiling_cpu_casts_in_reduce_overhead_mode_stays_silent() -> None:
    torch._dynamo.reset()
    layer = fp8state.Linear(32, 32)
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8state.fp8_autocast():
            y = compiled(torch.randn(16, 32))
        y.sum().backward()
    assert not [w for w in caught if "reduce-overhead" in str(w.message)]
    assert layer.weight.grad is not None
    assert bool(layer.fp8_meta("bwd").amax_history[0, 0] > 0)  # the compiled casts ran
