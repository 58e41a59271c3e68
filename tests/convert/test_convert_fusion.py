"""convert_model's norm + linear fusion: named pairs, pairs found in nn.Sequential, refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers.tiny_lm import TINY_LM_PAIRS, convert_quietly, tiny_lm, tokens
from torch import nn

import fp8state
from fp8state.convert import FusedFrom
from fp8state.errors import ConversionError


def test_named_pairs_become_layernorm_linear_with_the_same_parameters() -> None:
    model = tiny_lm()
    ln, qkv = model.blocks[0].ln_1, model.blocks[0].qkv
    convert_quietly(model, layernorm_linear=TINY_LM_PAIRS)
    fused = model.blocks[0].qkv
    assert type(fused) is fp8state.LayerNormLinear and fused.normalization == "LayerNorm"
    assert type(model.blocks[0].ln_1) is nn.Identity
    assert fused.layer_norm_weight is ln.weight and fused.layer_norm_bias is ln.bias
    assert fused.weight is qkv.weight and fused.bias is qkv.bias
    assert fused.eps == ln.eps
    assert fused.fp8_fused_from == FusedFrom(norm="blocks.0.ln_1", linear="blocks.0.qkv")
    assert model.blocks[1].mlp[0].fp8_fused_from == FusedFrom("blocks.1.ln_2", "blocks.1.mlp.0")
    assert type(model.ln_f) is fp8state.LayerNorm  # not in a pair: converted on its own
    assert {k for k in model.state_dict() if k.startswith("blocks.0.qkv.")} == {
        "blocks.0.qkv.layer_norm_weight",
        "blocks.0.qkv.layer_norm_bias",
        "blocks.0.qkv.weight",
        "blocks.0.qkv.bias",
        "blocks.0.qkv._extra_state",
    }
    report = fp8state.plan_conversion(tiny_lm(), layernorm_linear=TINY_LM_PAIRS)
    assert report["blocks.0.ln_1"].action == "fuse"
    assert report["blocks.0.ln_1"].target == "torch.nn.Identity"
    assert report["blocks.0.qkv"].target == "fp8state.LayerNormLinear"
    assert all(p.fused for p in report.pairs) and len(report.pairs) == 4


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_fused_model_is_bit_identical_outside_autocast_forward_and_backward(mode: str) -> None:
    original = getattr(tiny_lm(), mode)()
    duplicate = copy.deepcopy(original)
    # The conversion keeps Parameter objects, so the copy's names identify them afterwards.
    name_of = {id(p): n for n, p in duplicate.named_parameters()}
    fused = convert_quietly(duplicate, layernorm_linear=TINY_LM_PAIRS)
    out_ref, out = original(tokens()), fused(tokens())
    assert torch.equal(out, out_ref)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    reference = dict(original.named_parameters())
    params = list(fused.parameters())
    assert {id(p) for p in params} == set(name_of)
    for param in params:
        assert torch.equal(param.grad, reference[name_of[id(param)]].grad), name_of[id(param)]


def test_rmsnorm_pair_fuses_to_rmsnorm_layernorm_linear() -> None:
    model = nn.Sequential(nn.RMSNorm(16, eps=1e-6), nn.Linear(16, 32, bias=False))
    with torch.no_grad():
        model[0].weight.normal_(1.0, 0.3)
    original = copy.deepcopy(model)
    convert_quietly(model, layernorm_linear=[("0", "1")])
    assert model[1].normalization == "RMSNorm" and model[1].layer_norm_bias is None
    assert model[1].bias is None
    x = torch.randn(3, 16)
    assert torch.equal(model(x), original(x))
    assert set(model.state_dict()) == {"1.layer_norm_weight", "1.weight", "1._extra_state"}


def test_sequential_pairs_are_found_when_asked() -> None:
    class OwnOrder(nn.Sequential):  # a subclass may not run its children in order
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self[1](x)

    model = nn.Sequential(
        nn.LayerNorm(16),
        nn.Linear(16, 32),
        nn.GELU(),
        nn.LayerNorm(32),
        nn.Dropout(0.0),
        nn.Linear(32, 16),
        OwnOrder(nn.LayerNorm(16), nn.Linear(16, 16)),
    )
    report = fp8state.plan_conversion(model, layernorm_linear_sequential=True)
    assert [(p.norm, p.linear, p.fused) for p in report.pairs] == [("0", "1", True)]
    convert_quietly(model, layernorm_linear_sequential=True)
    assert type(model[0]) is nn.Identity and type(model[1]) is fp8state.LayerNormLinear
    assert type(model[3]) is fp8state.LayerNorm  # followed by a Dropout: not a pair
    assert type(model[6][1]) is fp8state.Linear
    assert fp8state.plan_conversion(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))).pairs == ()


@pytest.mark.parametrize(
    ("pairs", "key", "found"),
    [
        ([("blocks.0.ln_9", "blocks.0.qkv")], "blocks.0.ln_9", "no module of that name"),
        (
            [("blocks.0.qkv", "blocks.0.proj")],
            "(blocks.0.qkv, blocks.0.proj)",
            "the norm 'blocks.0.qkv' is a torch.nn.Linear and the linear layer 'blocks.0.proj' "
            "is a torch.nn.Linear",
        ),
        ([("blocks.0.ln_1", "emb")], "(blocks.0.ln_1, emb)", "torch.nn.Embedding"),
        (
            [("blocks.0.ln_1", "blocks.0.mlp.2")],
            "(blocks.0.ln_1, blocks.0.mlp.2)",
            "takes 64 features",
        ),
        (
            [("blocks.0.ln_1", "blocks.0.qkv"), ("blocks.0.ln_1", "blocks.0.proj")],
            "blocks.0.ln_1",
            "already named in the pair",
        ),
    ],
)
def test_wrong_pairs_are_errors_and_change_nothing(
    pairs: list[tuple[str, str]], key: str, found: str
) -> None:
    model = tiny_lm()
    before = dict(model.named_modules())
    with pytest.raises(ConversionError) as info:
        fp8state.convert_model(model, layernorm_linear=pairs)
    assert info.value.key == key and found in info.value.found
    assert dict(model.named_modules()) == before


def test_a_swapped_pair_is_one_sentence_naming_both_modules() -> None:
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    with pytest.raises(ConversionError) as info:
        fp8state.convert_model(model, layernorm_linear=[("1", "0")])
    assert info.value.found == (
        "the norm '1' is a torch.nn.Linear and the linear layer '0' is a torch.nn.LayerNorm "
        "(the two names look swapped: the norm comes first)"
    )
    assert info.value.fix == "Name the norm first: layernorm_linear=[('0', '1')]."
    assert str(info.value).count("expected") == 1
    assert type(model[0]) is nn.LayerNorm and type(model[1]) is nn.Linear


def test_a_pair_that_cannot_fuse_is_warned_about_and_converted_alone() -> None:
    model = nn.Sequential(nn.LayerNorm(16, bias=False), nn.Linear(16, 32))
    with pytest.warns(UserWarning) as record:
        fp8state.convert_model(model, layernorm_linear=[("0", "1")])
    message = str(record[0].message)
    assert len(record) == 1
    assert "pair (0, 1) not fused: 0: bias=False" in message
    assert "0 (torch.nn.LayerNorm): bias=False" in message
    assert type(model[0]) is nn.LayerNorm and type(model[1]) is fp8state.Linear
    model = nn.Sequential(nn.LayerNorm(16, bias=False), nn.Linear(16, 32))
    with pytest.raises(ConversionError) as info:
        fp8state.convert_model(model, layernorm_linear=[("0", "1")], on_unsupported="raise")
    assert info.value.key == "0, (0, 1)"
    assert type(model[1]) is nn.Linear


def test_shared_norm_is_not_fused() -> None:
    norm = nn.LayerNorm(16)
    model = nn.Sequential(norm, nn.Linear(16, 16), norm, nn.Linear(16, 16))
    with pytest.warns(UserWarning, match="reachable under 2 names"):
        fp8state.convert_model(model, layernorm_linear=[("0", "1")])
    assert type(model[0]) is fp8state.LayerNorm and model[0] is model[2]
    assert type(model[1]) is fp8state.Linear


def test_a_filtered_member_keeps_the_pair_apart_without_a_warning() -> None:
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32))
    convert_quietly(model, layernorm_linear=[("0", "1")], module_filter_fn=lambda m, n: n != "0")
    assert type(model[0]) is nn.LayerNorm and type(model[1]) is fp8state.Linear
    report = fp8state.plan_conversion(
        nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32)),
        layernorm_linear=[("0", "1")],
        module_filter_fn=lambda m, n: n != "0",
    )
    assert report.pairs[0].filtered and "excluded 0" in report.pairs[0].reason
    assert report.problems() == []


def test_fused_model_on_meta_keeps_meta_and_records_names() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32))
    convert_quietly(model, layernorm_linear_sequential=True)
    assert model[1].weight.device.type == "meta"
    assert model[1].fp8_meta("fwd").scale.device.type == "meta"
    assert model[1].fp8_fused_from == FusedFrom("0", "1")
