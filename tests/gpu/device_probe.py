"""Measure what a process holds on a GPU: torch's allocator, the CUDA context, NVML usage.

Used by ``two_gpu_device_proof.py``. Nothing here creates a CUDA context: the torch figures
read allocator statistics and ask whether a primary context exists; NVML and ``nvidia-smi``
run outside CUDA. Every source may be missing (no pynvml, no nvidia-smi, a container that
hides other PIDs); a missing source reads ``None`` ("unknown"), never ``0``. The parsing is
pure so that CPU tests cover it.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

Runner = Callable[[list[str]], str | None]


@dataclass(frozen=True)
class ProcessUsage:
    """One compute process on one GPU, as NVML or ``nvidia-smi`` lists it."""

    pid: int
    used_mib: float | None
    gpu_uuid: str


def _num(text: str) -> float | None:
    text = text.strip().removesuffix("MiB").strip()
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_compute_apps(text: str) -> list[ProcessUsage]:
    """Parse ``nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv``.

    Accepts the output with or without the header line and with or without units.
    """
    out = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 3 or not row[0].strip().isdigit():
            continue  # header, blank line, "No running processes found"
        out.append(ProcessUsage(int(row[0]), _num(row[1]), row[2].strip()))
    return out


def parse_gpus(text: str) -> list[dict[str, Any]]:
    """Parse ``nvidia-smi --query-gpu=index,uuid,memory.used,name --format=csv``."""
    out = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 4 or not row[0].strip().isdigit():
            continue
        out.append(
            {
                "index": int(row[0]),
                "uuid": row[1].strip(),
                "memory_used_mib": _num(row[2]),
                "name": row[3].strip(),
            }
        )
    return out


def run_command(args: list[str], timeout: float = 30.0) -> str | None:
    """Stdout of ``args``, or None if the program is missing or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def smi_gpus(runner: Runner = run_command) -> list[dict[str, Any]] | None:
    """Every GPU with index, uuid, used memory and name; None without ``nvidia-smi``."""
    text = runner(
        ["nvidia-smi", "--query-gpu=index,uuid,memory.used,name", "--format=csv,noheader,nounits"]
    )
    return None if text is None else parse_gpus(text)


def smi_processes(runner: Runner = run_command) -> list[ProcessUsage] | None:
    """Every compute process on every GPU; None without ``nvidia-smi``."""
    text = runner(
        [
            "nvidia-smi",
            "--query-compute-apps=pid,used_memory,gpu_uuid",
            "--format=csv,noheader,nounits",
        ]
    )
    return None if text is None else parse_compute_apps(text)


def nvml_processes() -> list[ProcessUsage] | None:
    """Every compute process on every GPU through NVML; None without pynvml."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = proc.usedGpuMemory
                    out.append(
                        ProcessUsage(int(proc.pid), None if used is None else used / 2**20, uuid)
                    )
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any NVML failure means "unknown", reported as None
        return None


def normalize_uuid(uuid: str) -> str:
    """``GPU-5C2B...`` (NVML, nvidia-smi) and ``5c2b...`` (torch) compare equal."""
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def process_on_gpu(
    pid: int,
    gpu_uuid: str | None,
    sources: dict[str, Callable[[], list[ProcessUsage] | None]] | None = None,
) -> dict[str, Any]:
    """Whether ``pid`` has a context on the GPU ``gpu_uuid``, per source (NVML, nvidia-smi).

    Returns ``{"present": bool | None, "used_mib": float | None, "source": str | None,
    "pids_seen": [...]}``: ``present`` is None when no source could tell.
    """
    sources = (
        sources
        if sources is not None
        else {"nvml": nvml_processes, "nvidia-smi": lambda: smi_processes()}
    )
    for name, source in sources.items():
        procs = source()
        if procs is None or gpu_uuid is None:
            continue
        here = [p for p in procs if normalize_uuid(p.gpu_uuid) == normalize_uuid(gpu_uuid)]
        mine = [p for p in here if p.pid == pid]
        used = sum(p.used_mib or 0.0 for p in mine) if mine else 0.0
        return {
            "present": bool(mine),
            "used_mib": used,
            "source": name,
            "pids_seen": sorted({p.pid for p in here}),
        }
    return {"present": None, "used_mib": None, "source": None, "pids_seen": []}


def torch_figures(index: int) -> dict[str, Any]:
    """Allocator statistics and primary-context state of ``cuda:index``, creating nothing."""
    if not torch.cuda.is_available():
        return {"available": False}
    has_ctx = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return {
        "available": True,
        # Asked first: everything after it only reads host-side statistics.
        "primary_context": bool(has_ctx(index)) if has_ctx is not None else None,
        "memory_allocated": int(torch.cuda.memory_allocated(index)),
        "memory_reserved": int(torch.cuda.memory_reserved(index)),
        "max_memory_allocated": int(torch.cuda.max_memory_allocated(index)),
    }


def snapshot(index: int, pid: int, uuids: dict[int, str], *, cuda: bool = True) -> dict[str, Any]:
    """Everything known about this process on ``cuda:index``, and the GPU's total use.

    ``cuda=False`` (the CPU dry run) asks neither CUDA nor NVML anything and reads what a
    machine without CUDA reads, whatever GPUs this machine has: the dry run's ``cuda:1`` need
    not exist (one GPU), and asking CUDA about it raises.
    """
    if not cuda:
        return {
            "torch": {"available": False},
            "process": process_on_gpu(pid, None, {}),
            "gpu_memory_used_mib": None,
        }
    gpus = smi_gpus() if torch.cuda.is_available() else None
    uuid = uuids.get(index)
    total = next(
        (
            g["memory_used_mib"]
            for g in gpus or []
            if uuid and normalize_uuid(g["uuid"]) == normalize_uuid(uuid)
        ),
        None,
    )
    return {
        "torch": torch_figures(index),
        "process": process_on_gpu(pid, uuid),
        "gpu_memory_used_mib": total,
    }


def as_dict(usage: ProcessUsage) -> dict[str, Any]:
    """JSON-ready form of a :class:`ProcessUsage`."""
    return asdict(usage)
