"""Two-GPU proof that loading never touches a GPU other than the module's; writes JSON figures.

Usage (repo root, a machine with two CUDA GPUs; fp8state importable or not, either works)::

    python tests/gpu/two_gpu_device_proof.py RESULT.json
    python tests/gpu/two_gpu_device_proof.py RESULT.json --cpu-dry-run   # logic only, no GPU

Scenarios, each in fresh processes (``proof_scenarios.py``):

1. ``fresh_process``: a process on cuda:0 saves (``torch.save`` and DCP); a *fresh* process
   that only uses cuda:1 loads through ``fp8state.checkpoint.load`` + ``load_state_dict``,
   ``dcp_load`` and ``torch.load(map_location="cuda:1")``. Then, as a control, plain
   ``torch.load`` without ``map_location``.
2. ``split_model``: one process, current device cuda:0, half the model on cuda:1 (TE issue
   3124's setting): loading adds nothing to cuda:0, neither allocated nor peak.
3. ``nccl_two_ranks``: rank 1 loads what rank 0 wrote with ``torch.save``; FSDP2 DCP round
   trip over NCCL; the replicated-metadata check over NCCL; the plain ``torch.load`` control.

For cuda:0 the figures are ``torch.cuda.memory_allocated/memory_reserved``, whether a primary
context exists, and the process's entry in NVML (pynvml) or ``nvidia-smi`` (per-PID usage).
A per-PID "absent" only counts when the same source lists the process on cuda:1 (a container
may hide PIDs); otherwise that check reads "inconclusive". Exit code: 0 all checks passed,
1 some failed, 2 fewer than two GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import device_probe  # noqa: E402
from proof_checks import evaluate  # noqa: E402

_SCENARIOS = _HERE / "proof_scenarios.py"


def _environment(cuda: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if cuda else 0,
        "nvidia_smi_gpus": device_probe.smi_gpus(),
        "pynvml": _has_pynvml(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import fp8state

        env["fp8state"] = fp8state.__version__
    except ImportError:
        env["fp8state"] = None
    return env


def _has_pynvml() -> bool:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return False
    return True


def _uuids(cuda: bool) -> dict[int, str]:
    """torch device index -> GPU uuid as NVML/nvidia-smi print it (``GPU-...``)."""
    if not cuda:
        return {}
    import torch

    out = {}
    for i in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", "") or "")
        if uuid:
            out[i] = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    smi = {g["index"]: g["uuid"] for g in device_probe.smi_gpus() or []}
    known = {device_probe.normalize_uuid(u) for u in smi.values()}
    if smi and (
        len(out) < torch.cuda.device_count()
        or not {device_probe.normalize_uuid(u) for u in out.values()} <= known
    ):
        # torch's uuids missing or in another spelling: children use PCI bus order, which
        # is nvidia-smi's.
        out = smi
    return out


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # torch index == nvidia-smi index
    # NVLink multicast stays off: on a shared host it can take the GPUs out of service.
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    root = str(_HERE.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def _run(
    names: list[tuple[str, dict[str, str]]], config: Path, work: Path, timeout: float
) -> list[dict[str, Any]]:
    """Start ``names`` together (one process each), wait, return their JSON results."""
    procs = []
    for i, (name, extra) in enumerate(names):
        out = work / f"{name}-{i}.json"
        log = open(work / f"{name}-{i}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                out,
                log,
                subprocess.Popen(
                    [sys.executable, str(_SCENARIOS), name, str(config), str(out)],
                    env=_child_env(extra),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    deadline = time.monotonic() + timeout
    results = []
    for out, log, proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        result = json.loads(out.read_text()) if out.exists() else {}
        result["returncode"] = proc.returncode
        result["log_tail"] = Path(log.name).read_text()[-4000:]
        results.append(result)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_proof(out_path: Path, *, cpu_dry_run: bool, kind: str, timeout: float) -> int:
    """Run every scenario, write ``out_path``, return the exit code."""
    cuda = not cpu_dry_run
    if cuda:
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    report: dict[str, Any] = {
        "mode": "cpu-dry-run" if cpu_dry_run else "two-gpu",
        "environment": _environment(cuda),
    }
    if cuda and report["environment"]["device_count"] < 2:
        report["passed"] = False
        report["error"] = "needs two CUDA devices"
        _write(out_path, report)
        return 2
    with tempfile.TemporaryDirectory(prefix="fp8state-proof-") as tmp:
        work = Path(tmp)
        config = work / "config.json"
        config.write_text(
            json.dumps({"cuda": cuda, "work": str(work), "kind": kind, "uuids": _uuids(cuda)})
        )
        report["uuids"] = json.loads(config.read_text())["uuids"]
        scenarios: dict[str, list[dict[str, Any]]] = {}
        report["scenarios"] = scenarios
        port = str(_free_port())
        ranks = [
            (
                "nccl_rank",
                {
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                },
            )
            for r in range(2)
        ]
        plan = [
            ("save", [("save_dev0", {})]),
            ("fresh_process", [("load_dev1", {})]),
            ("split_model", [("split_current_dev0", {})]),
            ("nccl_two_ranks", ranks),
        ]
        for name, processes in plan:
            print(f"running {name} ...", flush=True)
            scenarios[name] = _run(processes, config, work, timeout)
            _write(out_path, report)  # partial figures survive a kill of this process
    report["checks"] = evaluate(scenarios, cuda=cuda)
    report["passed"] = all(c["status"] in ("pass", "n/a") for c in report["checks"])
    _write(out_path, report)
    for check in report["checks"]:
        print(f"{check['status']:>12}  {check['name']}: {check['detail']}")
    print(f"{'PASSED' if report['passed'] else 'FAILED'}; figures in {out_path}")
    return 0 if report["passed"] else 1


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the proof."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write the figures to")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run every scenario on the CPU (checks the logic, not devices)",
    )
    parser.add_argument(
        "--kind",
        default="te",
        choices=["te", "mixin"],
        help="te: fp8state.Linear/LayerNormMLP; mixin: the test mixin model",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds per scenario before its processes are killed",
    )
    args = parser.parse_args(argv)
    return run_proof(args.out, cpu_dry_run=args.cpu_dry_run, kind=args.kind, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
