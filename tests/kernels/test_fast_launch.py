"""FastLauncher's caching logic, with stand-ins for Triton's JIT and compiled kernels (CPU)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from fp8state._kernels import launch as _launch
from fp8state._kernels.launch import FastLauncher, int_spec


class _Compiled:
    def __init__(self, log: list) -> None:
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *args) -> None:
        self.log.append(("direct", args))


class _Jit:
    """Records slow-path launches; returns a fresh compiled kernel each time (as a cache miss)."""

    def __init__(self, compiled_factory) -> None:
        self.log: list = []
        self.factory = compiled_factory

    def __getitem__(self, grid):
        def launch(*args, num_warps):
            self.log.append(("jit", grid, args, num_warps))
            return self.factory(self.log)

        return launch


@pytest.fixture
def fake_cuda(monkeypatch):
    state = SimpleNamespace(current=0, switched=[])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state.current)

    @contextlib.contextmanager
    def device(index):
        state.switched.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(_launch, "raw_stream", lambda index: 1000 + index)
    monkeypatch.setattr(
        _launch, "_RUNTIME", [SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)]
    )
    return state


def test_version_parsing() -> None:
    assert _launch._version("3.6.0") == (3, 6, 0)
    assert _launch._version("3.6.1+git1234") == (3, 6, 1)
    assert _launch._version("3.7.0rc1")[:2] not in _launch._DIRECT_VERSIONS


def test_pre_run_hooks_keep_tritons_path(fake_cuda) -> None:
    jit = _Jit(_Compiled)
    jit.pre_run_hooks = [print]
    launcher = FastLauncher(jit)
    for _ in range(2):
        launcher("k", (1,), (), torch.device("cuda", 0))
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_compiles_once_per_key_then_launches_directly(fake_cuda) -> None:
    jit = _Jit(_Compiled)
    launcher = FastLauncher(jit)
    dev = torch.device("cuda", 0)
    for _ in range(3):
        launcher("k1", (4,), (1, 2, 3), dev, num_warps=8)
    kinds = [entry[0] for entry in jit.log]
    assert kinds == ["jit", "direct", "direct"]
    assert jit.log[1][1] == (4, 1, 1, 1000, "fn", "meta", None, None, None, 1, 2, 3)
    launcher("k2", (2, 3), (5,), dev, num_warps=8)  # another key compiles again
    assert jit.log[3][0] == "jit"
    launcher("k2", (2, 3), (5,), dev, num_warps=8)
    assert jit.log[4][1][:3] == (2, 3, 1)


def test_other_device_takes_triton_path_under_device_switch(fake_cuda) -> None:
    jit = _Jit(_Compiled)
    launcher = FastLauncher(jit)
    for _ in range(2):
        launcher("k", (1,), (9,), torch.device("cuda", 1), num_warps=4)
    assert [e[0] for e in jit.log] == ["jit", "jit"]
    assert fake_cuda.switched == [1, 1]


def test_hooks_force_triton_path(fake_cuda, monkeypatch) -> None:
    jit = _Jit(_Compiled)
    launcher = FastLauncher(jit)
    dev = torch.device("cuda", 0)
    launcher("k", (1,), (), dev)
    monkeypatch.setattr(
        _launch, "_RUNTIME", [SimpleNamespace(launch_enter_hook=print, launch_exit_hook=None)]
    )
    launcher("k", (1,), (), dev)
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_empty_hook_chains_count_as_no_hooks(fake_cuda, monkeypatch) -> None:
    """Triton 3.5+ holds hooks in chain objects that are never None; empty means no hook."""
    chain = SimpleNamespace(calls=[])
    monkeypatch.setattr(
        _launch, "_RUNTIME", [SimpleNamespace(launch_enter_hook=chain, launch_exit_hook=chain)]
    )
    jit = _Jit(_Compiled)
    launcher = FastLauncher(jit)
    dev = torch.device("cuda", 0)
    launcher("k", (1,), (), dev)
    launcher("k", (1,), (), dev)
    assert [e[0] for e in jit.log] == ["jit", "direct"]
    chain.calls.append(print)  # a profiler installs a hook: Triton's path again
    launcher("k", (1,), (), dev)
    assert [e[0] for e in jit.log] == ["jit", "direct", "jit"]


def test_unknown_compiled_interface_disables_direct_path(fake_cuda) -> None:
    jit = _Jit(lambda log: object())  # no run/function/packed_metadata
    launcher = FastLauncher(jit)
    dev = torch.device("cuda", 0)
    for _ in range(3):
        launcher("k", (1,), (), dev)
    assert [e[0] for e in jit.log] == ["jit", "jit", "jit"]


@pytest.mark.parametrize(
    "value,spec",
    [
        (1, (True, False, True)),
        (32, (False, True, True)),
        (2**31, (False, True, False)),
        (7, (False, False, True)),
    ],
)
def test_int_spec(value, spec) -> None:
    assert int_spec(value) == spec
