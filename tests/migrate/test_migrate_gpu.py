"""On a GPU machine: migrating a TE checkpoint whose tensors were saved on ``cuda:0`` creates no
CUDA context and allocates nothing on any GPU; loading into a module on ``cuda`` allocates only
there. Each check runs in a fresh process, where CUDA is certainly not initialised yet."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _helpers.paths import TESTS
from te_gen import ERAS, Module, Spec, build, save

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SCRIPT = """
import json, sys, warnings
sys.path.insert(0, {tests!r})
import torch
import fp8state
from fp8state.migrate import load_te_checkpoint
result = {{}}
sd = load_te_checkpoint({path!r})
result["context_after_migrate"] = torch.cuda.is_initialized()
result["devices"] = sorted({{t.device.type for v in sd.values()
                            for t in (v.values() if isinstance(v, dict) else [v])}})
linear = fp8state.Linear(8, 12, device="cuda:0")
before = torch.cuda.memory_allocated(0)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    linear.load_state_dict({{k[2:]: v for k, v in sd.items() if k.startswith("a.")}})
result["buffer_device"] = str(linear.fp8_meta("fwd").scale.device)
result["grew_on_cuda0"] = torch.cuda.memory_allocated(0) >= before
print(json.dumps(result))
"""


@pytest.mark.parametrize("era", ERAS)
def test_migrating_cuda_tagged_files_creates_no_cuda_context(era: str, tmp_path: Path) -> None:
    gen = build(era, [Module("a.", "Linear", spec=Spec(rows=4)), Module("n.", "LayerNorm")])
    path = tmp_path / "te.pt"
    save(gen, path, params_on="cuda:0")
    code = textwrap.dedent(SCRIPT.format(tests=str(TESTS), path=str(path)))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {
        "context_after_migrate": False,
        "devices": ["cpu"],
        "buffer_device": "cuda:0",
        "grew_on_cuda0": True,
    }
    assert torch.cuda.is_available()
