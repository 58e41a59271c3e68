"""The public TE fixtures (tests/fixtures): bit-exact conversion against their JSON truth,
strict loading into fp8state modules, and the two adversarial files."""

from __future__ import annotations

import collections
import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers.paths import FIXTURES
from _helpers.state import fields, sub_state_dict

import fp8state
from fp8state import scaling
from fp8state.errors import LegacyFormatError, UnsafeCheckpointError
from fp8state.migrate import load_te_checkpoint, migrate_te_checkpoint
from fp8state.migrate.reader import read_checkpoint

LEGACY = FIXTURES / "te_legacy"
REAL = FIXTURES / "te_real_2.20"
assert LEGACY.is_dir() and REAL.is_dir(), f"TE fixtures missing at {FIXTURES} (tests/fixtures)"
LEGACY_FILES = sorted(LEGACY.glob("te_E*.pt"))
REAL_FILES = sorted(REAL.glob("*.pt"))
assert len(LEGACY_FILES) == 10 and len(REAL_FILES) == 3
MAXIMA = {(448, 57344): 1, (448, 448): 0}  # fp8 maxima -> schema format code


def _truth(path: Path) -> dict[str, Any]:
    return json.loads(path.with_suffix(".json").read_text())


def _f32(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _reference(path: Path) -> dict[str, Any]:
    """The file as torch's own weights-only reader sees it (the trusted reference)."""
    with torch.serialization.safe_globals([io.BytesIO, collections.deque]):
        return torch.load(path, weights_only=True, map_location="cpu")


@pytest.fixture(scope="module", params=LEGACY_FILES, ids=lambda p: p.stem[:3] + p.stem[3:6])
def legacy(request: pytest.FixtureRequest) -> tuple[Path, dict[str, Any], Any, Any]:
    path = request.param
    converted, report = migrate_te_checkpoint(path)
    return path, _truth(path), converted, report


def _expected_tensors(module: dict[str, Any], d: str, end: bool) -> dict[str, torch.Tensor]:
    """docs/migration.md's conversion rules (slots, scales, history order), applied to the
    sidecar's TE-ordered values."""
    m = module[d]
    scale = _f32(m["scale"])
    inv = _f32(m["scale_inv"]) if m["scale_inv"] is not None else 1 / scale
    hist = _f32(m["amax_history"])
    rows = hist.shape[0]
    order = list(range(rows - 1, -1, -1)) if end else [0, *range(rows - 1, 0, -1)]
    hist = hist[order]
    n_te = scale.numel()
    gemms = module["num_gemms"]
    n = gemms * (3 if d == "fwd" else 2)
    cols = list(range(n))
    if n_te != n:  # TE v0.1-v0.5: 2 fwd / 1 bwd per GEMM
        cols = (
            [3 * g + r for g in range(gemms) for r in (0, 1)]
            if d == "fwd"
            else [2 * g for g in range(gemms)]
        )
    out = {"scale": torch.ones(n), "scale_inv": torch.ones(n), "amax_history": torch.zeros(rows, n)}
    out["scale"][cols], out["scale_inv"][cols], out["amax_history"][:, cols] = scale, inv, hist
    return out


def test_legacy_fp8_modules_bit_exact(legacy: tuple[Path, dict, Any, Any]) -> None:
    _, truth, converted, _ = legacy
    end = truth["generator"]["amax_update_timing"] == "end"
    checked = 0
    for module in truth["modules"].values():
        if not module.get("fp8_tensors_stored"):
            continue
        payload = fields(converted[module["extra_state_key"]])
        for d in ("fwd", "bwd"):
            if module[d]["scale_inv"] is None:  # TE's own fallback agrees with 1/scale
                assert torch.equal(
                    1 / _f32(module[d]["scale"]),
                    _f32(module[d]["scale_inv_not_stored_but_te_would_use"]),
                )
            for field, want in _expected_tensors(module, d, end).items():
                assert torch.equal(payload[f"{d}.{field}"], want), (module["extra_state_key"], d)
        checked += 1
    assert checked >= 6


def test_legacy_recipe_follows_rules(legacy: tuple[Path, dict, Any, Any]) -> None:
    _, truth, converted, report = legacy
    entries = {e.key: e for e in report.entries}
    for module in truth["modules"].values():
        if not module.get("fp8_tensors_stored"):
            continue
        key = module["extra_state_key"]
        p, rec = fields(converted[key]), module["recipe"]
        rows = len(module["fwd"]["amax_history"])
        assert int(p["recipe.amax_history_len"]) == rows
        efv = module["stored"].get("extra_fp8_variables") or {}
        if module["recipe_stored_in_checkpoint"]:
            want = (
                {"HYBRID": 1, "E4M3": 0}[rec["fp8_format"]],
                rec["margin"],
                ["max", "most_recent"].index(rec["amax_compute_algo"]),
                (),
            )
        else:
            maxima = (efv.get("fp8_max_fwd"), efv.get("fp8_max_bwd"))
            stored = maxima in MAXIMA
            want = (
                MAXIMA.get(maxima, 1),
                0,
                0,
                (() if stored else ("fp8_format",)) + ("margin", "amax_compute_algo"),
            )
        got = (
            int(p["recipe.fp8_format"]),
            int(p["recipe.margin"]),
            int(p["recipe.amax_compute_algo"]),
            entries[key].defaulted,
        )
        assert got == want, key


def test_legacy_fp8_off_entries(legacy: tuple[Path, dict, Any, Any]) -> None:
    _, truth, converted, report = legacy
    actions = {e.key: e.action for e in report.entries}
    assert actions["lm_head._extra_state"] == "default"  # Linear: GEMM count known
    lm = fields(converted["lm_head._extra_state"])
    assert lm["fwd.scale"].shape == (3,) and bool((lm["fwd.amax_history"] == 0).all())
    if "final_norm._extra_state" in truth["state_dict_keys_in_order"]:  # norms from v1.13
        assert actions["final_norm._extra_state"] == "dropped"
        assert "final_norm._extra_state" not in converted
    fp8_keys = {m["extra_state_key"] for m in truth["modules"].values() if m.get("fp8")}
    assert {k for k, a in actions.items() if a == "converted"} == fp8_keys


def test_legacy_other_tensors_bit_identical(legacy: tuple[Path, dict, Any, Any]) -> None:
    path, truth, converted, report = legacy
    reference = _reference(path)
    others = [k for k in truth["state_dict_keys_in_order"] if not k.endswith("_extra_state")]
    assert list(truth["tensors"]) == others and report.other_tensors == len(others)
    for key in others:
        got, ref = converted[key], reference[key]
        assert got.dtype == ref.dtype and got.device.type == "cpu" and torch.equal(got, ref)
        assert list(got.shape) == truth["tensors"][key]["shape"]
        assert got.double().sum().item() == pytest.approx(truth["tensors"][key]["sum_float64"])
    kept = [k for k in truth["state_dict_keys_in_order"] if k in converted]
    assert list(converted) == kept  # key order preserved


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.stem)
def test_real_te_2_20_files(path: Path) -> None:
    truth = _truth(path)
    converted, report = migrate_te_checkpoint(path)
    for prefix, module in truth["modules"].items():
        p = fields(converted[f"{prefix}._extra_state"])
        for d in ("fwd", "bwd"):
            scale = _f32(module[f"scale_{d}"]["values"])
            hist = _f32(module[f"amax_history_{d}"]["values"])
            assert torch.equal(p[f"{d}.scale"], scale)
            assert torch.equal(p[f"{d}.scale_inv"], 1 / scale)
            assert torch.equal(p[f"{d}.amax_history"], hist.flip(0))  # v1.6+: ours[k]=te[L-1-k]
            # Independent check of the order: TE's scale is fp8_max / max(window) of the history.
            fp8_max = 448.0 if d == "fwd" else 57344.0
            want, _ = scaling.update_scale(
                p[f"{d}.amax_history"],
                p[f"{d}.scale"],
                window=1024,
                algo="max",
                fp8_max=fp8_max,
                margin=0,
            )
            assert torch.equal(want, p[f"{d}.scale"])
        assert int(p["recipe.amax_history_len"]) == 1024 and int(p["recipe.fp8_format"]) == 1
    for key, meta in truth["tensors"].items():
        assert list(converted[key].shape) == meta["shape"]
        assert converted[key].device.type == "cpu" and meta["device"] == "cuda:0"
    assert all("cuda:0" in e.locations for e in report.entries if "core_attention" not in e.key)


LEGACY_MODULES = [
    ("input_proj.", lambda: fp8state.Linear(24, 32)),
    ("blocks.0.ln_proj.", lambda: fp8state.LayerNormLinear(32, 32)),
    ("blocks.0.mlp.", lambda: fp8state.LayerNormMLP(32, 64)),
    ("lm_head.", lambda: fp8state.Linear(32, 40, bias=False)),
]
REAL_MODULES = {
    "te2.20_linear_bias_default": [("proj.", lambda: fp8state.Linear(64, 32))],
    "te2.20_lnmlp_gelu_default": [("mlp.", lambda: fp8state.LayerNormMLP(64, 128))],
    "te2.20_transformer_layer_default": [
        ("layer.self_attention.proj.", lambda: fp8state.Linear(64, 64)),
        ("layer.layernorm_mlp.", lambda: fp8state.LayerNormMLP(64, 128)),
    ],
}


@pytest.mark.parametrize("path", LEGACY_FILES + REAL_FILES, ids=lambda p: p.stem[:12])
def test_te_names_load_strict_into_fp8state_modules(path: Path) -> None:
    converted = load_te_checkpoint(path)
    raw = read_checkpoint(path).obj  # unconverted TE values: set_extra_state decodes them
    modules = REAL_MODULES.get(path.stem, LEGACY_MODULES)
    for prefix, make in modules:
        for sd in (converted, raw):
            module = make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # history rows differ from the module's 1024
                result = module.load_state_dict(sub_state_dict(sd, prefix), strict=True)
            assert not result.missing_keys and not result.unexpected_keys
            want = fields(converted[f"{prefix}_extra_state"])
            for d in ("fwd", "bwd"):
                meta = module.fp8_meta(d)
                rows = want[f"{d}.amax_history"].shape[0]
                assert torch.equal(meta.scale, want[f"{d}.scale"])
                assert torch.equal(meta.scale_inv, want[f"{d}.scale_inv"])
                assert torch.equal(meta.amax_history[:rows], want[f"{d}.amax_history"])
                assert bool((meta.amax_history[rows:] == 0).all())
            for name, param in module.named_parameters():
                assert torch.equal(param, converted[f"{prefix}{name}"]), name


MARKER = Path("/tmp/PWNED_fp8state")  # the path the public adversarial pickle would create


def test_adversarial_os_system_refused_and_not_run() -> None:
    path = LEGACY / "adv_a_pickle_exec_os_system.pt"
    existed = MARKER.exists()
    with pytest.raises(UnsafeCheckpointError) as info:
        load_te_checkpoint(path)
    err = info.value
    assert err.key == "input_proj._extra_state" and "posix.system" in err.found
    assert err.expected and err.fix
    with pytest.warns(UserWarning, match="dropped 1 undecodable"):
        converted = load_te_checkpoint(path, strict=False)
    assert "input_proj._extra_state" not in converted
    assert "blocks.0.mlp._extra_state" in converted and "input_proj.weight" in converted
    _, report = migrate_te_checkpoint(path, strict=False)
    (failed,) = report.failed()
    assert failed.key == "input_proj._extra_state" and "posix.system" in (failed.error or "")
    assert existed or not MARKER.exists()


@pytest.mark.parametrize("strict", [True, False])
def test_truncated_file(strict: bool) -> None:
    with pytest.raises(LegacyFormatError) as info:
        load_te_checkpoint(LEGACY / "adv_b_truncated.pt", strict=strict)
    assert info.value.key.endswith("adv_b_truncated.pt") and "zip" in info.value.found
