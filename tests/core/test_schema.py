"""The extra-state schema (fp8state.schema): golden payload, bit-exact round trip, versions and
the upgrader registry, and one test id per malformed payload."""

from __future__ import annotations

import re
import types
from collections import OrderedDict
from collections.abc import Mapping

import pytest
import torch
from _helpers.corruptions import CORRUPTIONS, KEYS_V1, Mutation, copy_payload
from _helpers.paths import DOCS, FIXTURES
from _helpers.state import assert_same

import fp8state
from fp8state import schema
from fp8state.errors import FP8StateError, SchemaError, SchemaVersionError
from fp8state.formats import Format
from fp8state.recipe import DelayedScaling
from fp8state.schema import SCHEMA_VERSION, DirectionState, FP8State, pack, unpack

I64, F32 = torch.int64, torch.float32


def golden_payload() -> dict[str, torch.Tensor]:
    """A version-1 payload written out by hand: 1 GEMM, 2 history rows, E4M3, margin 1,
    window 2, most_recent. Any fp8state release must read it as :func:`golden_state`."""
    return {
        "schema_version": torch.tensor(1, dtype=I64),
        "fwd.amax_history": torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.5, 0.0]], dtype=F32),
        "fwd.scale": torch.tensor([224.0, 112.0, 1.0], dtype=F32),
        "fwd.scale_inv": torch.tensor([1 / 224, 1 / 112, 1.0], dtype=F32),
        "bwd.amax_history": torch.tensor([[8.0, 0.0], [0.0, 0.0]], dtype=F32),
        "bwd.scale": torch.tensor([28.0, 1.0], dtype=F32),
        "bwd.scale_inv": torch.tensor([1 / 28, 1.0], dtype=F32),
        "recipe.fp8_format": torch.tensor(0, dtype=I64),
        "recipe.margin": torch.tensor(1, dtype=I64),
        "recipe.amax_history_len": torch.tensor(2, dtype=I64),
        "recipe.amax_compute_algo": torch.tensor(1, dtype=I64),
    }


def golden_v2() -> torch.Tensor:
    """golden_payload's fields as schema 2 writes them, written out by hand: the header
    [version, GEMMs, rows, format, margin, window, algo], then the six tensors flattened."""
    return torch.tensor(
        [2, 1, 2, 0, 1, 2, 1]
        + [1.0, 2.0, 0.0, 4.0, 0.5, 0.0]
        + [224.0, 112.0, 1.0, 1 / 224, 1 / 112, 1.0]
        + [8.0, 0.0, 0.0, 0.0]
        + [28.0, 1.0, 1 / 28, 1.0],
        dtype=F32,
    )


def golden_state() -> FP8State:
    p = golden_payload()
    return FP8State(
        DirectionState(p["fwd.amax_history"], p["fwd.scale"], p["fwd.scale_inv"]),
        DirectionState(p["bwd.amax_history"], p["bwd.scale"], p["bwd.scale_inv"]),
        DelayedScaling(
            margin=1,
            fp8_format=Format.E4M3,
            amax_history_len=2,
            amax_compute_algo="most_recent",
        ),
    )


def assert_state_equal(a: FP8State, b: FP8State) -> None:
    assert a.recipe == b.recipe
    for d in ("fwd", "bwd"):
        for f in ("amax_history", "scale", "scale_inv"):
            torch.testing.assert_close(
                getattr(a.direction(d), f).cpu(),
                getattr(b.direction(d), f).cpu(),
                atol=0,
                rtol=0,
            )


# ---------------------------------------------------------------- golden and round trip


def test_golden_payload_keys_are_the_spec() -> None:
    assert SCHEMA_VERSION == 2
    assert set(golden_payload()) == KEYS_V1
    assert set(schema.as_mapping(golden_v2())) == KEYS_V1


def test_pack_writes_the_golden_payload() -> None:
    assert_same(pack(golden_state()), golden_v2())


def test_unpack_reads_both_golden_versions_alike() -> None:
    v1, v2 = unpack(golden_payload()), unpack(golden_v2())
    assert_state_equal(v1, golden_state())
    assert_state_equal(v2, golden_state())
    # The mapping form of either is the version-2 mapping (the upgrader only bumps the version).
    assert int(schema.as_mapping(golden_payload())["schema_version"]) == 2


def test_golden_files_of_both_versions_load() -> None:
    """Files written once by fp8state (tests/fixtures/schema/README.md): every release must
    read them as the in-code goldens, and write version 2 as the file holds it."""
    folder = FIXTURES / "schema"
    v1 = torch.load(folder / "linear_v1.pt", weights_only=True)
    v2 = torch.load(folder / "linear_v2.pt", weights_only=True)
    assert isinstance(v1["_extra_state"], dict) and isinstance(v2["_extra_state"], torch.Tensor)
    assert_same(v1["_extra_state"], golden_payload())
    assert_same(v2["_extra_state"], golden_v2())

    class OneGemm(fp8state.FP8StateMixin):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 3))
            self.init_fp8_meta(num_gemms=1, history_rows=2)

    for sd in (v1, v2):
        layer = OneGemm()
        layer.load_state_dict(sd)
        assert_same(layer.get_extra_state(), golden_v2())
        assert torch.equal(layer.weight, v1["weight"])


def test_unpack_reads_the_golden_payload() -> None:
    state = unpack(golden_payload(), num_gemms=1)
    assert_state_equal(state, golden_state())
    assert (state.rows, state.num_gemms) == (2, 1)


def test_default_payload() -> None:
    p = schema.as_mapping(schema.default_payload(num_gemms=2, rows=8))
    assert set(p) == KEYS_V1
    torch.testing.assert_close(p["fwd.amax_history"], torch.zeros(8, 6), atol=0, rtol=0)
    torch.testing.assert_close(p["bwd.amax_history"], torch.zeros(8, 4), atol=0, rtol=0)
    for k in ("fwd.scale", "fwd.scale_inv"):
        torch.testing.assert_close(p[k], torch.ones(6), atol=0, rtol=0)
    for k in ("bwd.scale", "bwd.scale_inv"):
        torch.testing.assert_close(p[k], torch.ones(4), atol=0, rtol=0)
    assert unpack(p).recipe == DelayedScaling(amax_history_len=8)


def _random_state(gemms: int, rows: int, seed: int) -> FP8State:
    gen = torch.Generator().manual_seed(seed)

    def direction(n: int) -> DirectionState:
        scale = torch.exp2(torch.rand(n, generator=gen) * 60 - 30)
        return DirectionState(
            torch.exp2(torch.rand(rows, n, generator=gen) * 60 - 30), scale, 1 / scale
        )

    recipe = DelayedScaling(margin=3, amax_history_len=rows, amax_compute_algo="most_recent")
    return FP8State(direction(3 * gemms), direction(2 * gemms), recipe)


@pytest.mark.parametrize(("gemms", "rows"), [(1, 1), (2, 16), (3, 1024)], ids=str)
def test_round_trip_is_bit_exact(gemms: int, rows: int, seed: int) -> None:
    state = _random_state(gemms, rows, seed)
    payload = pack(state)
    assert_state_equal(unpack(payload, num_gemms=gemms), state)
    assert_same(pack(unpack(payload)), payload)


def test_pack_returns_cpu_copies(device: torch.device) -> None:
    state = _random_state(1, 4, 0)
    on_dev = FP8State(
        *(
            DirectionState(*(t.to(device) for t in (d.amax_history, d.scale, d.scale_inv)))
            for d in (state.fwd, state.bwd)
        ),
        state.recipe,
    )
    payload = pack(on_dev)
    assert payload.device.type == "cpu"
    ptrs = {
        t.untyped_storage().data_ptr()
        for d in (on_dev.fwd, on_dev.bwd)
        for t in (d.amax_history, d.scale, d.scale_inv)
    }
    assert payload.untyped_storage().data_ptr() not in ptrs
    assert_state_equal(unpack(payload), state)


def test_unpack_does_not_copy_and_accepts_any_mapping() -> None:
    p = golden_payload()
    for mapping in (OrderedDict(p), types.MappingProxyType(p)):
        state = unpack(mapping)
        assert state.fwd.scale is p["fwd.scale"]


def test_unpack_accepts_views_and_grad_tensors() -> None:
    p = golden_payload()
    p["fwd.amax_history"] = p["fwd.amax_history"].T.contiguous().T  # non-contiguous
    p["fwd.scale"] = torch.nn.Parameter(p["fwd.scale"])
    assert_state_equal(unpack(p), golden_state())


# ---------------------------------------------------------------- versions and upgraders


@pytest.mark.parametrize("version", [3, 99, 2**40], ids=["v3", "v99", "v2pow40"])
def test_newer_version_names_both_versions(version: int) -> None:
    p = {**golden_payload(), "schema_version": torch.tensor(version)}
    with pytest.raises(SchemaVersionError) as info:
        unpack(p)
    msg = str(info.value)
    assert f"version {version}" in msg and f"version {SCHEMA_VERSION}" in msg
    assert "Upgrade fp8state" in msg
    assert info.value.key == "['schema_version']"


@pytest.mark.parametrize("version", [0, -1], ids=["v0", "v-1"])
def test_unknown_older_version(version: int) -> None:
    p = {**golden_payload(), "schema_version": torch.tensor(version)}
    with pytest.raises(SchemaVersionError, match=f"version {version}"):
        unpack(p)


def v0_payload() -> dict[str, torch.Tensor]:
    """A made-up version-0 layout: per-direction keys suffixed, no scale_inv, the recipe as one
    int64 vector [format, margin, window, algo]. Same contents as the golden v1 payload."""
    g = golden_payload()
    return {
        "schema_version": torch.tensor(0),
        "amax_history_fwd": g["fwd.amax_history"].clone(),
        "scale_fwd": g["fwd.scale"].clone(),
        "amax_history_bwd": g["bwd.amax_history"].clone(),
        "scale_bwd": g["bwd.scale"].clone(),
        "recipe": torch.tensor([0, 1, 2, 1]),
    }


def upgrade_v0(old: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    new = {"schema_version": torch.tensor(1)}
    for d in ("fwd", "bwd"):
        new[f"{d}.amax_history"] = old[f"amax_history_{d}"]
        new[f"{d}.scale"] = old[f"scale_{d}"]
        new[f"{d}.scale_inv"] = torch.reciprocal(old[f"scale_{d}"])
    fields = ("fp8_format", "margin", "amax_history_len", "amax_compute_algo")
    for field, value in zip(fields, old["recipe"], strict=True):
        new[f"recipe.{field}"] = value.clone()
    return new


def test_registered_upgrader_loads_old_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(schema.UPGRADERS, 0, upgrade_v0)
    old = v0_payload()
    before = {k: v.clone() for k, v in old.items()}
    state = unpack(old, num_gemms=1)
    assert_state_equal(state, golden_state())
    assert_same(old, before)  # the payload is not modified
    assert_same(pack(state), golden_v2())


def test_unregistered_old_version_raises() -> None:
    assert 0 not in schema.UPGRADERS
    with pytest.raises(SchemaVersionError, match="version 0"):
        unpack(v0_payload())


def test_upgraders_run_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def upgrade_minus1(old: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(-1)
        return {**old, "schema_version": torch.tensor(0)}

    def logged_v0(old: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(0)
        return upgrade_v0(old)

    monkeypatch.setitem(schema.UPGRADERS, -1, upgrade_minus1)
    monkeypatch.setitem(schema.UPGRADERS, 0, logged_v0)
    state = unpack({**v0_payload(), "schema_version": torch.tensor(-1)})
    assert calls == [-1, 0]
    assert_state_equal(state, golden_state())


def test_upgraded_payload_is_still_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(schema.UPGRADERS, 0, upgrade_v0)
    old = v0_payload()
    old["scale_fwd"][1] = -2.0
    with pytest.raises(SchemaError, match=r"fwd\.scale"):
        unpack(old)


def test_upgrader_skipping_a_version_is_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(schema.UPGRADERS, 0, lambda old: {**old, "schema_version": torch.tensor(0)})
    with pytest.raises(AssertionError, match="upgrader 0 produced version 0"):
        unpack(v0_payload())


# ---------------------------------------------------------------- malformed payloads


@pytest.mark.parametrize(
    ("mutate", "error", "key"),
    [pytest.param(m, e, k, id=i) for i, m, e, k in CORRUPTIONS],
)
def test_malformed_payload(mutate: Mutation, error: type[FP8StateError], key: str) -> None:
    payload = mutate(golden_payload())
    before = copy_payload(payload)
    with pytest.raises(error) as info:
        unpack(payload, num_gemms=1)
    assert type(info.value) is error
    assert key in info.value.key, (info.value.key, key)
    assert info.value.found and info.value.expected and info.value.fix
    assert_same(payload, before, nan_ok=True)  # validation never writes into the payload


def test_missing_keys_are_all_listed() -> None:
    p = golden_payload()
    del p["fwd.scale"], p["bwd.scale_inv"]
    with pytest.raises(SchemaError) as info:
        unpack(p)
    assert "bwd.scale_inv" in info.value.found and "fwd.scale" in info.value.found


def test_non_mapping_error_points_at_migration() -> None:
    with pytest.raises(SchemaError, match="migrate"):
        unpack(torch.zeros(0, dtype=torch.uint8))


# ---------------------------------------------------------------- the spec


def test_spec_documents_every_key_and_code() -> None:
    spec = (DOCS / "schema.md").read_text()
    for key in sorted(KEYS_V1):
        assert f"`{key}`" in spec, key
    assert re.search(r"version 1\b", spec), "changelog entry for version 1"
    assert re.search(r"version 2\b", spec), "changelog entry for version 2"
    for fmt in Format:
        assert re.search(rf"`{fmt.code}`[^\n]*{fmt.name}", spec), fmt
    for code, algo in enumerate(("max", "most_recent")):
        assert re.search(rf"`{code}`[^\n]*`{algo}`", spec), algo


def test_payload_keys_are_packs_keys_in_its_order() -> None:
    """Staging builds payloads in this order without calling pack: the two must agree."""
    assert tuple(schema.as_mapping(golden_payload())) == schema.PAYLOAD_KEYS
    assert tuple(schema.as_mapping(schema.default_payload(num_gemms=2))) == schema.PAYLOAD_KEYS
    assert tuple(schema.unpack(golden_v2()).as_mapping()) == schema.PAYLOAD_KEYS
