"""The two-GPU proof's logic on CPU: parsing, per-PID lookup, verdicts, and a full dry run.

The proof itself (tests/gpu/two_gpu_device_proof.py) runs once on a two-GPU machine; these
tests make sure that run cannot fail for a reason other than a real device problem, and that
its verdicts fail when the figures are bad.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers.paths import GPU_DIR

sys.path.insert(0, str(GPU_DIR))

import device_probe  # noqa: E402
from proof_checks import evaluate  # noqa: E402

_APPS = """pid, used_gpu_memory [MiB], gpu_uuid
4242, 584 MiB, GPU-aaaa
4243, [N/A], GPU-bbbb
"""


def test_parse_compute_apps_with_header_units_and_na() -> None:
    apps = device_probe.parse_compute_apps(_APPS)
    assert apps == [
        device_probe.ProcessUsage(4242, 584.0, "GPU-aaaa"),
        device_probe.ProcessUsage(4243, None, "GPU-bbbb"),
    ]
    assert device_probe.parse_compute_apps("No running processes found\n") == []
    assert device_probe.parse_compute_apps("7, 12, GPU-c\n") == [
        device_probe.ProcessUsage(7, 12.0, "GPU-c")
    ]


def test_parse_gpus() -> None:
    text = "0, GPU-aaaa, 3, NVIDIA H200\n1, GPU-bbbb, 590, NVIDIA H200\n"
    assert device_probe.parse_gpus(text)[1] == {
        "index": 1,
        "uuid": "GPU-bbbb",
        "memory_used_mib": 590.0,
        "name": "NVIDIA H200",
    }


def test_smi_wrappers_read_none_when_nvidia_smi_is_missing() -> None:
    assert device_probe.smi_processes(lambda args: None) is None
    assert device_probe.smi_gpus(lambda args: None) is None
    assert device_probe.smi_processes(lambda args: _APPS)[0].pid == 4242
    assert device_probe.run_command(["surely-not-a-program-fp8state"]) is None


def test_process_on_gpu_per_source() -> None:
    procs = device_probe.parse_compute_apps(_APPS)
    seen = device_probe.process_on_gpu(4242, "GPU-aaaa", {"fake": lambda: procs})
    assert seen == {"present": True, "used_mib": 584.0, "source": "fake", "pids_seen": [4242]}
    absent = device_probe.process_on_gpu(4242, "GPU-bbbb", {"fake": lambda: procs})
    assert absent["present"] is False and absent["pids_seen"] == [4243]
    # An unavailable first source falls through to the next; none at all reads "unknown".
    fallback = device_probe.process_on_gpu(
        4242, "GPU-aaaa", {"nvml": lambda: None, "smi": lambda: procs}
    )
    assert fallback["source"] == "smi"
    unknown = device_probe.process_on_gpu(4242, "GPU-aaaa", {"nvml": lambda: None})
    assert unknown["present"] is None and unknown["used_mib"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="figures of a machine without CUDA")
def test_torch_figures_without_cuda() -> None:
    assert device_probe.torch_figures(0) == {"available": False}


# ---------------------------------------------------------------- verdicts on GPU figures


def _fig(
    *,
    alloc: int = 0,
    reserved: int = 0,
    ctx: bool = False,
    present: bool = False,
    peak: int | None = None,
    source: str | None = "nvml",
) -> dict[str, Any]:
    return {
        "torch": {
            "available": True,
            "primary_context": ctx,
            "memory_allocated": alloc,
            "memory_reserved": reserved,
            "max_memory_allocated": alloc if peak is None else peak,
        },
        "process": {
            "present": present,
            "used_mib": 500.0 if present else 0.0,
            "source": source,
            "pids_seen": [],
        },
    }


def _step(result: Any = None) -> dict[str, Any]:
    return {"ok": True, "result": result}


def _good_gpu_run() -> dict[str, list[dict[str, Any]]]:
    on1 = {"equal": True, "fp8_buffers": [["Tensor", "cuda:1"]]}
    control = {"weights": ["cuda:0"], "fp8_metadata": ["cpu"]}
    fresh = {
        "returncode": 0,
        "pid": 2,
        "steps": {
            "fp8state_load": _step(on1),
            "dcp_load": _step(on1),
            "torch_load_map_location_dev1": _step(on1),
            "plain_torch_load": _step({**on1, "devices": dict(control)}),
        },
        "figures": {
            "baseline": _fig(),
            "baseline_own_gpu": _fig(present=True),
            "after_fp8state_load": _fig(),
            "after_dcp_load": _fig(),
            "after_fp8state_load_own_gpu": _fig(present=True),
            "after_torch_load_map_location_dev1": _fig(),
            "after_plain_torch_load": _fig(alloc=512, reserved=2**21, ctx=True, present=True),
        },
    }
    split = {
        "returncode": 0,
        "pid": 3,
        "steps": {
            "fp8state_load": _step({"a": [["Tensor", "cuda:0"]], "b": [["Tensor", "cuda:1"]]}),
            "verify": _step({"equal": True}),
        },
        "figures": {
            "before_load": _fig(alloc=4096, reserved=2**21, ctx=True),
            "after_load": _fig(alloc=4096, reserved=2**21, ctx=True),
        },
    }
    refused = {"raised": True, "written": False}
    rank0 = {
        "returncode": 0,
        "pid": 4,
        "rank": 0,
        "steps": {"fsdp2_dcp_round_trip": _step(), "replicated_check": _step(dict(refused))},
    }
    rank1 = {
        "returncode": 0,
        "pid": 5,
        "rank": 1,
        "steps": {
            "fp8state_load": _step(on1),
            "fsdp2_dcp_round_trip": _step(),
            "replicated_check": _step(dict(refused)),
            "plain_torch_load": _step(dict(control)),
        },
        "figures": {
            "baseline": _fig(),
            "baseline_own_gpu": _fig(present=True),
            "after_fp8state_load": _fig(),
            "after_fsdp2": _fig(),
            "after_plain_torch_load": _fig(alloc=512, ctx=True, present=True),
        },
    }
    save = {"returncode": 0, "pid": 1, "steps": {"dcp_save": _step(True)}}
    return {
        "save": [save],
        "fresh_process": [fresh],
        "split_model": [split],
        "nccl_two_ranks": [rank0, rank1],
    }


def _status(checks: list[dict[str, str]]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in checks}


def test_good_gpu_figures_pass_every_check() -> None:
    checks = evaluate(_good_gpu_run(), cuda=True)
    assert len(checks) == 16
    assert {c["status"] for c in checks} == {"pass"}, checks


@pytest.mark.parametrize(
    "mutate,failing",
    [
        (
            lambda r: r["fresh_process"][0]["figures"]["after_dcp_load"]["torch"].update(
                memory_reserved=2**21
            ),
            "fresh process: cuda:0 memory_allocated",
        ),
        (
            lambda r: r["fresh_process"][0]["figures"]["after_fp8state_load"]["torch"].update(
                primary_context=True
            ),
            "fresh process: no CUDA context on cuda:0",
        ),
        (
            lambda r: r["fresh_process"][0]["figures"]["after_fp8state_load"]["process"].update(
                present=True
            ),
            "fresh process: process absent from GPU 0",
        ),
        (
            lambda r: r["nccl_two_ranks"][1]["figures"]["after_fsdp2"]["torch"].update(
                memory_allocated=8
            ),
            "2 ranks, rank 1: cuda:0 memory_allocated",
        ),
        (
            lambda r: r["split_model"][0]["figures"]["after_load"]["torch"].update(
                max_memory_allocated=8192
            ),
            "split model: nothing added to cuda:0",
        ),
        (
            lambda r: r["nccl_two_ranks"][1]["steps"]["plain_torch_load"]["result"].update(
                fp8_metadata=["cuda:0"]
            ),
            "2 ranks, rank 1: plain torch.load",
        ),
        (
            lambda r: r["fresh_process"][0]["steps"]["dcp_load"].update(ok=False, error="boom"),
            "fresh process: every load equals",
        ),
        (
            lambda r: r["nccl_two_ranks"][0]["steps"]["replicated_check"]["result"].update(
                raised=False
            ),
            "2 ranks: differing FP8 metadata refused",
        ),
        (lambda r: r["save"][0].update(returncode=1), "every process finished"),
        (
            lambda r: r["nccl_two_ranks"][1]["figures"]["after_fsdp2"]["process"].update(
                present=True
            ),
            "2 ranks, rank 1: process's GPU 0 usage unchanged",
        ),
        (
            lambda r: r["nccl_two_ranks"][1]["figures"]["after_fp8state_load"]["torch"].update(
                primary_context=True
            ),
            "2 ranks, rank 1: no CUDA context on cuda:0 beyond",
        ),
    ],
)
def test_bad_gpu_figures_fail_the_right_check(mutate: Any, failing: str) -> None:
    run = copy.deepcopy(_good_gpu_run())
    mutate(run)
    statuses = _status(evaluate(run, cuda=True))
    failed = [name for name, status in statuses.items() if status == "fail"]
    assert len(failed) == 1 and failed[0].startswith(failing), statuses


def test_a_context_nccl_made_before_loading_is_not_blamed_on_loading() -> None:
    run = _good_gpu_run()
    for fig in run["nccl_two_ranks"][1]["figures"].values():
        if fig is not run["nccl_two_ranks"][1]["figures"]["baseline_own_gpu"]:
            fig["torch"]["primary_context"] = True
            fig["process"].update(present=True, used_mib=500.0)
    assert {c["status"] for c in evaluate(run, cuda=True)} == {"pass"}
    run["fresh_process"][0]["figures"]["baseline"]["torch"]["primary_context"] = True
    run["fresh_process"][0]["figures"]["after_dcp_load"]["torch"]["primary_context"] = True
    statuses = _status(evaluate(run, cuda=True))  # the fresh process allows no context at all
    assert statuses["fresh process: no CUDA context on cuda:0"] == "fail"


def test_hidden_pids_make_the_per_process_check_inconclusive_not_passing() -> None:
    run = _good_gpu_run()
    for fig in run["fresh_process"][0]["figures"].values():
        fig["process"].update(present=False)  # a container: NVML sees no PID at all
    statuses = _status(evaluate(run, cuda=True))
    assert statuses["fresh process: process absent from GPU 0 (NVML / nvidia-smi)"] == (
        "inconclusive"
    )


def _dry_run(tmp_path: Path) -> None:
    """Run the proof with ``--cpu-dry-run`` and check its report: every check passes or is n/a."""
    out = tmp_path / "proof.json"
    done = subprocess.run(
        [
            sys.executable,
            str(GPU_DIR / "two_gpu_device_proof.py"),
            str(out),
            "--cpu-dry-run",
            "--timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["mode"] == "cpu-dry-run"
    statuses = _status(report["checks"])
    assert sorted(set(statuses.values())) == ["n/a", "pass"]
    assert sum(s == "pass" for s in statuses.values()) == 9
    ranks = report["scenarios"]["nccl_two_ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1]


@pytest.mark.slow
def test_cpu_dry_run_of_the_whole_proof(tmp_path: Path) -> None:
    _dry_run(tmp_path)


#: Loaded first by every process of a dry run (``sitecustomize``): the probe's torch sees
#: ``{count}`` CUDA devices, and asking it about any other index raises as torch does.
_GPUS_SEEN = """
import os
import sys
import types

sys.path.insert(0, {gpu_dir!r})
import device_probe

with open({marker!r}, "a") as marker:
    marker.write(f"{{os.getpid()}}\\n")


def _check(device):
    index = 0 if device is None else int(getattr(device, "index", device) or 0)
    if not 0 <= index < {count}:
        raise RuntimeError("hasPrimaryContext expects a valid device index, "
                           f"but got device_index={{index}}")


def _has_primary_context(device):
    _check(device)
    return False


def _bytes(device=None):
    _check(device)
    return 0


_cuda = types.SimpleNamespace(
    is_available=lambda: True, device_count=lambda: {count}, memory_allocated=_bytes,
    memory_reserved=_bytes, max_memory_allocated=_bytes)
_c = types.SimpleNamespace(_cuda_hasPrimaryContext=_has_primary_context)
device_probe.torch = types.SimpleNamespace(cuda=_cuda, _C=_c)
"""


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2], ids=["one-gpu", "two-gpus"])
def test_cpu_dry_run_asks_cuda_about_no_device(
    tmp_path: Path, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dry run asks CUDA nothing, so it passes whatever GPUs the machine has: with one GPU,
    asking about the ``cuda:1`` of a GPU run raises, and every scenario would die of it."""
    shim, marker = tmp_path / "shim", tmp_path / "processes.txt"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        _GPUS_SEEN.format(gpu_dir=str(GPU_DIR), marker=str(marker), count=count)
    )
    # Children inherit it (the proof adds the repository root to PYTHONPATH, keeping the rest).
    monkeypatch.setenv("PYTHONPATH", str(shim), prepend=";" if sys.platform == "win32" else ":")
    _dry_run(tmp_path)
    # The proof, its saver, fresh loader, split model and two ranks all saw the simulated GPUs.
    assert len(marker.read_text().split()) == 6
