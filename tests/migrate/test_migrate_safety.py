"""Nothing in a checkpoint runs: every non-allow-listed global is refused by name, in every place
pickled data can hide; undecodable bytes are LegacyFormatError; TE is never imported."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers.paths import FIXTURES, REPO_ROOT, TESTS
from te_gen import Spec, extra_state
from te_gen.adversarial import MARKER_TEXT, PLACES, TEPickleModule, payloads

from fp8state._te.unpickler import loads
from fp8state.errors import FP8StateError, LegacyFormatError, UnsafeCheckpointError
from fp8state.migrate import decode_te_extra_state, load_te_checkpoint

PAYLOAD_IDS = list(payloads("unused"))


def _no_marker(marker: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out, err = capfd.readouterr()
    assert not marker.exists(), "a pickled payload ran"
    assert MARKER_TEXT not in out + err, "a pickled payload printed"


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("payload", PAYLOAD_IDS)
def test_payload_refused_in_extra_state(
    payload: str, place: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    obj, name = payloads(str(marker))[payload]
    value = PLACES[place](obj)
    with pytest.raises(UnsafeCheckpointError) as info:
        decode_te_extra_state(value, num_gemms=1)
    err = info.value
    assert name in err.found and err.expected and "Nothing was executed" in err.fix
    _no_marker(marker, capfd)


@pytest.mark.parametrize("payload", PAYLOAD_IDS)
def test_payload_refused_in_outer_checkpoint(
    payload: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    obj, name = payloads(str(marker))[payload]
    path = tmp_path / "evil.pt"
    torch.save(
        {"model": {"x.weight": torch.ones(2, 2), "x._extra_state": None}, "args": obj},
        path,
        pickle_module=TEPickleModule,
    )
    for strict in (True, False):  # the outer file cannot be read partially: always fatal
        with pytest.raises(UnsafeCheckpointError) as info:
            load_te_checkpoint(path, strict=strict)
        assert info.value.key == str(path) and name in info.value.found
    _no_marker(marker, capfd)


def test_lenient_drops_only_the_bad_entry(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    marker = tmp_path / "marker"
    good, truth = extra_state("E09", Spec())
    sd = {
        "a.weight": torch.ones(12, 8),
        "a._extra_state": good,
        "b.weight": torch.ones(12, 8),
        "b._extra_state": PLACES["inside-recipe-dict"](payloads(str(marker))["os.system"][0]),
    }
    path = tmp_path / "mixed.pt"
    torch.save(sd, path)
    with pytest.raises(UnsafeCheckpointError, match=r"^b\._extra_state: "):
        load_te_checkpoint(path)
    with pytest.warns(UserWarning, match="b._extra_state"):
        out = load_te_checkpoint(path, strict=False)
    assert set(out) == {"a.weight", "a._extra_state", "b.weight"}
    _no_marker(marker, capfd)


def _pickle_ops(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def test_build_cannot_set_attributes_on_allowed_globals() -> None:
    # GLOBAL torch._utils._rebuild_tensor_v2; BUILD (None, {"__doc__": "pwned"}): plain pickle
    # would setattr on torch's function for the whole process.
    before = torch._utils._rebuild_tensor_v2.__doc__
    data = _pickle_ops(
        b"ctorch._utils\n_rebuild_tensor_v2\n",
        b"N}",
        _unicode("__doc__"),
        _unicode("pwned"),
        b"s\x86b",
    )
    with pytest.raises(LegacyFormatError, match="setting the state of a function"):
        loads(data)
    assert torch._utils._rebuild_tensor_v2.__doc__ == before
    # The same on a stand-in class itself (not an instance).
    data = _pickle_ops(
        b"ctransformer_engine.common.recipe\nDelayedScaling\n}",
        _unicode("__setstate__"),
        b"N",
        b"sb",
    )
    with pytest.raises(LegacyFormatError, match="setting the state of a type"):
        loads(data)


def test_codecs_encode_only_for_bytes() -> None:
    data = _pickle_ops(b"c_codecs\nencode\n", _unicode("payload"), _unicode("rot13"), b"\x86R")
    with pytest.raises(LegacyFormatError, match="_codecs.encode"):
        loads(data)
    ok = _pickle_ops(b"c_codecs\nencode\n", _unicode("\xe9t\xe9"), _unicode("latin1"), b"\x86R")
    assert loads(ok) == "\xe9t\xe9".encode("latin-1")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit is deprecated
def test_torchscript_archive_refused(tmp_path: Path) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    with pytest.raises(UnsafeCheckpointError, match="TorchScript"):
        load_te_checkpoint(path)


def _undecodable_values() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    good = extra_state("E08", Spec())[0]
    archive = extra_state("E07", Spec())[0].getvalue()
    values: dict[str, Any] = {}
    for i in range(8):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        values[f"random-{i}"] = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    for cut in (1, 2, 50, good.numel() // 2, good.numel() - 1):
        values[f"truncated-pickle-{cut}"] = good[:cut].clone()
    for cut in (10, len(archive) // 2, len(archive) - 30):
        values[f"truncated-archive-{cut}"] = io.BytesIO(archive[:cut])
    values["empty-bytesio"] = io.BytesIO()
    values["pickled-int"] = torch.frombuffer(bytearray(b"\x80\x04K\x05."), dtype=torch.uint8)
    values["persistent-id"] = torch.frombuffer(
        bytearray(b"\x80\x02X\x01\x00\x00\x00aQ."), dtype=torch.uint8
    )
    return values


@pytest.mark.parametrize("name", list(_undecodable_values()))
def test_undecodable_bytes(name: str) -> None:
    value = _undecodable_values()[name]
    with pytest.raises(FP8StateError) as info:
        decode_te_extra_state(value)
    # Random bytes may by chance name a global; anything else is a LegacyFormatError.
    assert isinstance(info.value, (LegacyFormatError, UnsafeCheckpointError))
    assert info.value.found and info.value.expected and info.value.fix


def test_random_file_is_a_legacy_format_error(tmp_path: Path) -> None:
    path = tmp_path / "noise.pt"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(LegacyFormatError):
        load_te_checkpoint(path)


FAKE_TE = """
import pathlib
pathlib.Path({marker!r}).write_text("transformer_engine was imported")
"""

NO_IMPORT_SCRIPT = """
import glob, io, sys, torch
sys.path.insert(0, {tests!r})
from te_gen import ERAS, Spec, extra_state
from fp8state.migrate import decode_te_extra_state, load_te_checkpoint
import fp8state
for path in sorted(glob.glob({fixtures!r} + "/*/te*.pt")):
    load_te_checkpoint(path)
for era in ERAS:
    value, _ = extra_state(era, Spec())
    fp8state.Linear(8, 12).load_state_dict(
        {{"weight": torch.zeros(12, 8), "bias": torch.zeros(12), "_extra_state": value}})
assert "transformer_engine" not in sys.modules, sorted(m for m in sys.modules if "transformer" in m)
print("OK")
"""


def test_transformer_engine_is_never_imported(tmp_path: Path) -> None:
    marker = tmp_path / "te_imported"
    pkg = tmp_path / "site" / "transformer_engine"
    (pkg / "common").mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_TE.format(marker=str(marker)))
    (pkg / "common" / "__init__.py").write_text(FAKE_TE.format(marker=str(marker)))
    (pkg / "common" / "recipe.py").write_text(FAKE_TE.format(marker=str(marker)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO_ROOT)])}
    check = subprocess.run(
        [sys.executable, "-c", "import transformer_engine.common.recipe"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0 and marker.exists()  # the fake package is importable
    marker.unlink()
    script = NO_IMPORT_SCRIPT.format(tests=str(TESTS), fixtures=str(FIXTURES))
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("OK") and not marker.exists()


def test_pickled_backward_hooks_are_refused() -> None:
    import collections

    class Hooked:
        def __reduce__(self) -> tuple[Any, ...]:
            hooks = collections.OrderedDict([(0, collections.OrderedDict)])
            return (
                torch._utils._rebuild_tensor_v2,
                (torch.ones(2)._typed_storage(), 0, (2,), (1,), True, hooks),
            )

    sd_value = torch.frombuffer(bytearray(__import__("pickle").dumps(Hooked())), dtype=torch.uint8)
    with pytest.raises(LegacyFormatError, match="backward hooks"):
        decode_te_extra_state(sd_value)


def test_refused_name_is_shown_on_one_line() -> None:
    # STACK_GLOBAL takes any strings: a name with a newline must not break the one-line message.
    data = b"\x80\x04" + _unicode("os\nsystem") + _unicode("x" * 500) + b"\x93."
    with pytest.raises(UnsafeCheckpointError) as info:
        loads(data)
    assert "\n" not in str(info.value) and "os\\nsystem" in info.value.found
    assert len(info.value.found) < 200
