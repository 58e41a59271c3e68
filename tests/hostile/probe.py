"""Run every reader of fp8state on one input, in this (fresh, memory-capped) process.

``python probe.py KIND PATH WORKDIR``: KIND is ``file`` or ``dcp``. Prints one JSON line:
per entry point, what happened (``ok``, or the exception's class and whether it is an
FP8StateError); for CLI commands their exit code, stdout and stderr; whether any class or
module attribute the readers' allow-lists name changed; whether the model loaded into
changed. The test that runs it (test_hostile_inputs.py) judges.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import resource
import sys
from collections.abc import Callable
from typing import Any

MEMORY_LIMIT = 4 * 2**30  # bytes of address space: a bomb fails here, not on the machine
resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

import torch  # noqa: E402  (after the limit: torch's own allocations count too)
from torch.distributed.checkpoint import metadata as dcp_metadata  # noqa: E402

import fp8state  # noqa: E402
import fp8state.checkpoint as ckpt  # noqa: E402
from fp8state.cli import main  # noqa: E402
from fp8state.errors import FP8StateError  # noqa: E402
from fp8state.migrate import load_te_checkpoint, migrate_te_checkpoint  # noqa: E402
from fp8state.migrate.summary import summarize_checkpoint  # noqa: E402

# Objects a crafted BUILD or REDUCE could change for the whole process.
WATCHED = [
    dcp_metadata.Metadata,
    dcp_metadata.TensorStorageMetadata,
    pathlib.PosixPath,
    torch.Size,
    torch.UntypedStorage,
    torch._utils._rebuild_tensor_v2,
    torch._utils._rebuild_parameter_with_state,
    dict,
]


def _attributes() -> list[list[str]]:
    return [sorted(map(str, vars(obj))) for obj in WATCHED]


def _call(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except FP8StateError as err:
        return {
            "raised": type(err).__name__,
            "fp8state_error": True,
            "one_line": "\n" not in str(err),
        }
    except BaseException as err:  # noqa: BLE001 - anything else escaping is what we look for
        return {"raised": type(err).__name__, "fp8state_error": False, "text": str(err)[:300]}
    return {"raised": None}


def _cli(*argv: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except BaseException as exc:  # noqa: BLE001
            code = f"escaped {type(exc).__name__}: {exc}"[:300]
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def run(kind: str, path: str, work: str) -> dict[str, Any]:
    before = _attributes()
    results: dict[str, Any] = {}
    if kind == "file":
        results["load_te_checkpoint"] = _call(lambda: load_te_checkpoint(path))
        results["migrate_te_checkpoint"] = _call(lambda: migrate_te_checkpoint(path))
        results["summarize_checkpoint"] = _call(lambda: summarize_checkpoint(path))
        results["cli inspect"] = _cli("inspect", path)
        results["cli migrate"] = _cli("migrate", path, f"{work}/migrated.pt")
    else:
        model = fp8state.Linear(16, 16)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        results["load_dcp_state_dict"] = _call(lambda: ckpt.load_dcp_state_dict(path))
        results["read_dcp_metadata"] = _call(lambda: ckpt.read_dcp_metadata(path))
        results["consolidate"] = _call(lambda: ckpt.consolidate(path, f"{work}/api.pt"))
        results["dcp_load"] = _call(lambda: ckpt.dcp_load(model, path))
        results["summarize_checkpoint"] = _call(lambda: summarize_checkpoint(path))
        results["cli inspect"] = _cli("inspect", path)
        results["cli consolidate"] = _cli("consolidate", path, f"{work}/cli.pt")
        after = model.state_dict()
        results["model_changed"] = any(not torch.equal(after[k], v) for k, v in state.items())
    results["attributes_changed"] = _attributes() != before
    return results


if __name__ == "__main__":
    print(json.dumps(run(*sys.argv[1:4])))
