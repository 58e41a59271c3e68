"""Verdicts of the two-GPU device proof, computed from the scenarios' JSON results.

Pure functions of the results, so CPU tests can feed them recorded or synthetic figures.
A check's status is ``pass``, ``fail``, ``inconclusive`` (a source could not tell, e.g.
NVML hides PIDs in a container) or ``n/a`` (a GPU-only check in the CPU dry run).
"""

from __future__ import annotations

from typing import Any

#: Figures taken after fp8state loaded something, per scenario; cuda:0 must be untouched.
_FRESH_LABELS = ("after_fp8state_load", "after_dcp_load", "after_torch_load_map_location_dev1")
_NCCL_LABELS = ("after_fp8state_load", "after_fsdp2")


def _check(name: str, status: str, detail: str) -> dict[str, str]:
    return {"name": name, "status": status, "detail": detail}


def _steps_ok(result: dict[str, Any], steps: tuple[str, ...]) -> tuple[bool, str]:
    bad = []
    for step in steps:
        record = result.get("steps", {}).get(step)
        if record is None:
            bad.append(f"{step}: did not run")
        elif not record["ok"]:
            bad.append(f"{step}: {record['error']}")
    if "fatal" in result:
        bad.append("fatal: " + result["fatal"].strip().splitlines()[-1])
    return not bad, "; ".join(bad) or "ok"


def _buffers_on(result: dict[str, Any], step: str, device: str) -> bool:
    record = result.get("steps", {}).get(step, {})
    placement = (record.get("result") or {}).get("fp8_buffers")
    return placement == [["Tensor", device]] or placement == [("Tensor", device)]


def _untouched(
    result: dict[str, Any],
    labels: tuple[str, ...],
    cuda: bool,
    what: str,
    *,
    relative: bool = False,
) -> list[dict[str, str]]:
    """Allocator, context and per-PID checks of cuda:0 at ``labels``.

    ``relative``: the context and per-PID readings may be what they were at ``baseline``
    (a process whose NCCL communicator is up before fp8state runs); the allocator must
    still read 0.
    """
    if not cuda:
        return [_check(f"{what}: cuda:0 untouched", "n/a", "CPU dry run")]
    figs = result.get("figures", {})
    missing = [label for label in (*labels, "baseline") if label not in figs]
    if missing:
        return [_check(f"{what}: cuda:0 untouched", "fail", f"no figures for {missing}")]
    torch_figs = {label: figs[label]["torch"] for label in labels}
    alloc = {
        label: (f["memory_allocated"], f["memory_reserved"]) for label, f in torch_figs.items()
    }
    out = [
        _check(
            f"{what}: cuda:0 memory_allocated and memory_reserved stay 0",
            "pass" if all(a == (0, 0) for a in alloc.values()) else "fail",
            ", ".join(
                f"{label}: {a[0]} B allocated, {a[1]} B reserved" for label, a in alloc.items()
            ),
        )
    ]
    ctx = {label: f["primary_context"] for label, f in torch_figs.items()}
    baseline = figs["baseline"]["torch"].get("primary_context")
    allowed = {False, baseline} if relative else {False}
    status = (
        "inconclusive"
        if None in ctx.values()
        else "pass"
        if set(ctx.values()) <= allowed
        else "fail"
    )
    out.append(
        _check(
            f"{what}: no CUDA context on cuda:0" + (" beyond baseline" if relative else ""),
            status,
            f"primary context per step {ctx}; at baseline {baseline}",
        )
    )
    out.append(_per_pid(figs, labels, what, relative))
    return out


def _per_pid(
    figs: dict[str, Any], labels: tuple[str, ...], what: str, relative: bool
) -> dict[str, str]:
    name = f"{what}: process absent from GPU 0 (NVML / nvidia-smi)"
    if relative:
        name = f"{what}: process's GPU 0 usage unchanged from baseline (NVML / nvidia-smi)"
    own = next(
        (figs[k]["process"] for k in (f"{labels[0]}_own_gpu", "baseline_own_gpu") if k in figs),
        None,
    )
    procs = {label: figs[label]["process"] for label in labels}
    sources = {p["source"] for p in procs.values()}
    if None in sources or own is None or own["present"] is not True:
        return _check(
            name,
            "inconclusive",
            f"the source cannot see this process on its own GPU (control: {own}); "
            f"cuda:0 readings {procs}",
        )
    present = {label: (p["present"], p["used_mib"]) for label, p in procs.items()}
    base = figs["baseline"]["process"]
    if relative:
        ok = all(v == (base["present"], base["used_mib"]) for v in present.values())
    else:
        ok = not any(p for p, _ in present.values())
    return _check(
        name,
        "pass" if ok else "fail",
        f"source {sources.pop()}; own GPU {own['used_mib']} MiB (control); GPU 0 "
        f"(present, MiB) at baseline {(base['present'], base['used_mib'])}, "
        f"then {present}",
    )


def _control(
    result: dict[str, Any], step: str, cuda: bool, what: str, nested: bool
) -> list[dict[str, str]]:
    record = result.get("steps", {}).get(step)
    name = f"{what}: plain torch.load without map_location (control)"
    if record is None or not record["ok"]:
        return [_check(name, "fail", str(record and record.get("error")))]
    devices = record["result"]["devices"] if nested else record["result"]
    want_weights = ["cuda:0"] if cuda else ["cpu"]
    ok = devices["weights"] == want_weights and devices["fp8_metadata"] == ["cpu"]
    detail = f"user weights on {devices['weights']}, FP8 metadata on {devices['fp8_metadata']}"
    figs = result.get("figures", {}).get("after_plain_torch_load", {})
    if cuda and figs:
        detail += (
            f"; cuda:0 then: context {figs['torch'].get('primary_context')}, "
            f"{figs['torch'].get('memory_allocated')} B allocated, process "
            f"{figs['process'].get('used_mib')} MiB ({figs['process'].get('source')})"
        )
    return [_check(name, "pass" if ok else "fail", detail)]


def _fresh(results: list[dict[str, Any]], cuda: bool) -> list[dict[str, str]]:
    result = results[0] if results else {}
    dev1 = "cuda:1" if cuda else "cpu"
    steps = ("fp8state_load", "dcp_load", "torch_load_map_location_dev1", "plain_torch_load")
    ok, detail = _steps_ok(result, steps)
    on_dev1 = all(_buffers_on(result, s, dev1) for s in steps)
    out = [
        _check(
            "fresh process: every load equals the checkpoint, FP8 buffers on " + dev1,
            "pass" if ok and on_dev1 else "fail",
            detail,
        )
    ]
    out += _untouched(result, _FRESH_LABELS, cuda, "fresh process")
    out += _control(result, "plain_torch_load", cuda, "fresh process", nested=True)
    return out


def _split(results: list[dict[str, Any]], cuda: bool) -> list[dict[str, str]]:
    result = results[0] if results else {}
    ok, detail = _steps_ok(result, ("fp8state_load", "verify"))
    stages = (result.get("steps", {}).get("fp8state_load") or {}).get("result") or {}
    want = {
        "a": [["Tensor", "cuda:0" if cuda else "cpu"]],
        "b": [["Tensor", "cuda:1" if cuda else "cpu"]],
    }
    out = [
        _check(
            "split model: equal values, each stage's FP8 buffers on its own device",
            "pass" if ok and stages == want else "fail",
            f"{detail}; {stages}",
        )
    ]
    if not cuda:
        return out + [_check("split model: nothing added to cuda:0", "n/a", "CPU dry run")]
    figs = result.get("figures", {})
    before, after = (
        figs.get("before_load", {}).get("torch"),
        figs.get("after_load", {}).get("torch"),
    )
    if not before or not after:
        return out + [_check("split model: nothing added to cuda:0", "fail", "no figures")]
    same = (
        after["memory_allocated"] == before["memory_allocated"]
        and after["memory_reserved"] == before["memory_reserved"]
        and after["max_memory_allocated"] == before["memory_allocated"]
    )
    return out + [
        _check(
            "split model: nothing added to cuda:0 (current device), not even transiently",
            "pass" if same else "fail",
            f"cuda:0 before {before['memory_allocated']} B / {before['memory_reserved']} B "
            f"reserved; after {after['memory_allocated']} B / {after['memory_reserved']} B, "
            f"peak {after['max_memory_allocated']} B",
        )
    ]


def _nccl(results: list[dict[str, Any]], cuda: bool) -> list[dict[str, str]]:
    by_rank = {r.get("rank"): r for r in results}
    rank0, rank1 = by_rank.get(0, {}), by_rank.get(1, {})
    ok, detail = _steps_ok(rank1, ("fp8state_load",))
    on_dev1 = _buffers_on(rank1, "fp8state_load", "cuda:1" if cuda else "cpu")
    out = [
        _check(
            "2 ranks: rank 1 loads rank 0's torch.save file through fp8state",
            "pass" if ok and on_dev1 else "fail",
            detail,
        )
    ]
    out += _untouched(rank1, _NCCL_LABELS, cuda, "2 ranks, rank 1", relative=True)
    both = [_steps_ok(r, ("fsdp2_dcp_round_trip",)) for r in (rank0, rank1)]
    out.append(
        _check(
            "2 ranks: FSDP2 DCP save/load round trip",
            "pass" if all(o for o, _ in both) else "fail",
            "; ".join(d for _, d in both),
        )
    )
    verdicts = [
        (r.get("steps", {}).get("replicated_check") or {}).get("result") or {}
        for r in (rank0, rank1)
    ]
    refused = all(v.get("raised") is True and v.get("written") is False for v in verdicts)
    out.append(
        _check(
            "2 ranks: differing FP8 metadata refused on both ranks, nothing written",
            "pass" if refused else "fail",
            str(verdicts),
        )
    )
    out += _control(rank1, "plain_torch_load", cuda, "2 ranks, rank 1", nested=False)
    return out


def _last_line(result: dict[str, Any]) -> str:
    """The last line of a crashed process's error (its fatal traceback, else its log)."""
    text = result.get("fatal") or result.get("log_tail") or ""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def evaluate(scenarios: dict[str, list[dict[str, Any]]], *, cuda: bool) -> list[dict[str, str]]:
    """Every check of the proof, in the order the report lists them."""
    everything = [r for results in scenarios.values() for r in results]
    crashed = [
        f"pid {r.get('pid')}: rc {r.get('returncode')}: {_last_line(r)}"
        for r in everything
        if r.get("returncode") != 0 or "fatal" in r
    ]
    checks = [
        _check(
            "every process finished",
            "fail" if crashed else "pass",
            "; ".join(crashed) or f"{len(everything)} processes, exit code 0",
        )
    ]
    save_ok, save_detail = _steps_ok(scenarios.get("save", [{}])[0], ("dcp_save",))
    checks.append(
        _check("save on dev0 (torch.save and DCP)", "pass" if save_ok else "fail", save_detail)
    )
    checks += _fresh(scenarios.get("fresh_process", []), cuda)
    checks += _split(scenarios.get("split_model", []), cuda)
    checks += _nccl(scenarios.get("nccl_two_ranks", []), cuda)
    return checks
