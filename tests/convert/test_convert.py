"""fp8state.convert_model: which modules it swaps, what it keeps, and what it leaves alone."""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers.tiny_lm import HIDDEN, TinyLM, convert_quietly, tiny_lm, tokens
from torch import nn
from torch.nn.utils import parametrize

import fp8state
from fp8state.errors import ConfigError, ConversionError
from fp8state.schema import default_payload


def test_swaps_exact_types_and_keeps_the_same_parameter_objects() -> None:
    model = tiny_lm()
    model.blocks[1].proj.weight.requires_grad_(False)
    before = dict(model.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_quietly(model)
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert kinds["blocks.0.qkv"] is fp8state.Linear
    assert kinds["blocks.1.mlp.2"] is fp8state.Linear
    assert kinds["head"] is fp8state.Linear
    assert kinds["blocks.0.ln_1"] is fp8state.LayerNorm and kinds["ln_f"] is fp8state.LayerNorm
    assert kinds["emb"] is nn.Embedding  # not a candidate
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert model.head.weight is model.emb.weight  # the tie survives
    assert not model.blocks[1].proj.weight.requires_grad
    # The optimizer built before the conversion still trains the converted model.
    old = model.blocks[0].qkv.weight.detach().clone()
    model(tokens()).sum().backward()
    optimizer.step()
    assert not torch.equal(model.blocks[0].qkv.weight, old)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_output_and_gradients_are_bit_identical_outside_fp8_autocast(mode: str) -> None:
    original = tiny_lm()
    getattr(original, mode)()
    converted = convert_quietly(copy.deepcopy(original))
    assert converted.training == original.training
    assert all(m.training == original.training for m in converted.modules())
    out_ref, out = original(tokens()), converted(tokens())
    assert torch.equal(out, out_ref)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    grads_ref = {n: p.grad for n, p in original.named_parameters()}
    for name, param in converted.named_parameters():
        assert torch.equal(param.grad, grads_ref[name]), name


def test_converted_linears_compute_in_fp8_under_autocast() -> None:
    model = convert_quietly(tiny_lm())
    reference = model(tokens())
    with fp8state.fp8_autocast(enabled=True):
        out = model(tokens())
    out.sum().backward()
    qkv = model.blocks[0].qkv
    assert qkv.fp8_last_gemm_backend == "emulated"
    assert (qkv.fp8_meta("fwd").amax_history[0, :2] > 0).all()  # input and weight recorded
    assert (qkv.fp8_meta("bwd").amax_history[0, 0] > 0).all()
    assert not torch.equal(out, reference)  # FP8 rounding happened ...
    assert torch.nn.functional.cosine_similarity(out.flatten(), reference.flatten(), dim=0) > 0.99


def test_fresh_fp8_metadata_on_the_weights_device() -> None:
    model = convert_quietly(nn.Sequential(nn.Linear(16, 32)))
    payload = model[0].get_extra_state()
    expected = default_payload(1, rows=model[0].fp8_meta("fwd").amax_history.shape[0])
    assert torch.equal(payload, expected)
    assert all(b.device.type == "cpu" and b.dtype == torch.float32 for b in model[0].buffers())
    assert model[0].fp8_min_gemm_macs is None  # the modules' defaults stay


def test_keeps_dtype_eps_bias_presence_and_training_mode() -> None:
    model = nn.Sequential(
        nn.Linear(16, 32, bias=False, dtype=torch.bfloat16),
        nn.LayerNorm(32, eps=1e-3, dtype=torch.bfloat16),
        nn.RMSNorm(32, eps=1e-6),
    ).eval()
    original = copy.deepcopy(model)
    convert_quietly(model)
    linear, norm, rms = model
    assert type(linear) is fp8state.Linear and linear.bias is None
    assert linear.weight.dtype == torch.bfloat16
    assert "bias" not in dict(linear.named_parameters())
    assert type(norm) is fp8state.LayerNorm and norm.eps == 1e-3
    assert norm.weight.dtype == torch.bfloat16 and norm.bias.dtype == torch.bfloat16
    assert type(rms) is fp8state.RMSNorm and rms.eps == 1e-6
    assert not any(m.training for m in model.modules())
    plain_keys = set(original.state_dict())
    assert set(model.state_dict()) == plain_keys | {"0._extra_state"}
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(model[:2](x), original[:2](x))
    y = torch.randn(4, 32)
    assert torch.equal(rms(y), original[2](y))


def test_model_on_meta_converts_without_memory_and_loads_later() -> None:
    with torch.device("meta"):
        model = TinyLM()
    weight = model.blocks[0].qkv.weight
    convert_quietly(model)
    qkv = model.blocks[0].qkv
    assert type(qkv) is fp8state.Linear and qkv.weight is weight
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    model.to_empty(device="cpu")
    reference = tiny_lm(seed=3)
    fp8state.checkpoint.load_plain_state_dict(model, reference.state_dict())
    assert torch.equal(model(tokens()), reference(tokens()))


def test_gemm_shapes_scaled_mm_cannot_take_stay_with_one_warning() -> None:
    model = nn.Sequential(
        nn.Linear(30, 64), nn.Linear(64, 10), nn.Linear(10, 16), nn.Linear(16, 16)
    )
    with pytest.warns(UserWarning) as record:
        fp8state.convert_model(model)
    assert len(record) == 1
    message = str(record[0].message)
    assert "3 module(s)" in message
    assert "0 (torch.nn.Linear): in_features=30 is not a positive multiple of 16" in message
    assert "1 (torch.nn.Linear): out_features=10" in message
    assert "2 (torch.nn.Linear): in_features=10" in message
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, nn.Linear, fp8state.Linear]


def test_on_unsupported_raise_names_every_module_and_changes_nothing() -> None:
    model = nn.Sequential(
        nn.LayerNorm(30),
        nn.Linear(30, 64),
        nn.Linear(64, 64),
        nn.Linear(64, 8, dtype=torch.float64),
    )
    before = list(model)
    with pytest.raises(ConversionError) as info:
        fp8state.convert_model(model, on_unsupported="raise")
    assert info.value.key == "1, 3"
    assert "in_features=30" in info.value.found and "torch.float64" in info.value.found
    assert "module_filter_fn" in info.value.fix
    assert list(model) == before  # not even the supported modules were swapped


def test_subclasses_are_never_swapped_and_never_warned_about() -> None:
    class LoRALinear(nn.Linear):
        def __init__(self, n: int) -> None:
            super().__init__(n, n)
            self.down = nn.Linear(n, 4, bias=False)  # low-rank adapter
            self.up = nn.Linear(4, n, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + self.up(self.down(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(HIDDEN, 2, batch_first=True)
            self.lora = LoRALinear(HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lora(self.attn(x, x, x, need_weights=False)[0])

    model = Net()
    original = copy.deepcopy(model)
    report = fp8state.plan_conversion(model)
    # in_proj_weight is a parameter of the attention, not a module: nothing to convert there.
    assert sorted(d.name for d in report) == ["attn.out_proj", "lora", "lora.down", "lora.up"]
    assert report["attn.out_proj"].action == "subclass"
    assert "nn.MultiheadAttention's out_proj" in report["attn.out_proj"].reason
    assert report["lora"].action == "subclass"
    assert report["lora.down"].action == "unsupported"  # rank 4: too small for FP8 GEMMs
    convert_quietly(model, module_filter_fn=lambda m, name: not name.startswith("lora."))
    assert type(model.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert type(model.lora) is LoRALinear
    x = torch.randn(2, 5, HIDDEN)
    assert torch.equal(model(x), original(x))


def test_parametrized_linear_is_a_subclass() -> None:
    class Symmetric(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.triu() + w.triu(1).transpose(0, 1)

    model = nn.Sequential(nn.Linear(16, 16))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    convert_quietly(model)
    assert parametrize.is_parametrized(model[0])
    assert fp8state.plan_conversion(model)["0"].action == "subclass"


def test_hooks_and_a_replaced_forward_would_be_dropped_so_the_module_stays() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    seen: list[str] = []
    model[0].register_forward_hook(lambda m, i, o: seen.append("hook"))
    original_forward = model[1].forward
    model[1].forward = lambda x: original_forward(x) * 2  # as accelerate's hooks do
    with pytest.warns(UserWarning, match="1 forward hooks registered on it"):
        fp8state.convert_model(model)
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear
    assert type(model[2]) is fp8state.Linear
    assert "forward was replaced on the instance" in fp8state.plan_conversion(model)["1"].reason
    model(torch.randn(2, 16))
    assert seen == ["hook"]


def test_norms_fp8state_cannot_express_stay() -> None:
    model = nn.Sequential(
        nn.LayerNorm(16, bias=False),
        nn.LayerNorm(16, elementwise_affine=False),
        nn.LayerNorm((4, 4)),
        nn.RMSNorm(16),
        nn.LayerNorm(16),
    )
    report = fp8state.plan_conversion(model)
    assert "bias=False" in report["0"].reason
    assert "elementwise_affine=False" in report["1"].reason
    assert "normalized_shape=(4, 4)" in report["2"].reason
    assert "eps=None" in report["3"].reason
    assert [d.action for d in report] == ["unsupported"] * 4 + ["convert"]
    with pytest.warns(UserWarning, match="4 module"):
        fp8state.convert_model(model)
    assert [type(m) for m in model][4] is fp8state.LayerNorm


def test_module_filter_fn_gets_module_and_name_once_per_candidate() -> None:
    model = tiny_lm()
    calls: list[tuple[type, str]] = []

    def keep(module: nn.Module, name: str) -> bool:
        calls.append((type(module), name))
        return not name.startswith("blocks.1")

    convert_quietly(model, module_filter_fn=keep)
    names = [name for _, name in calls]
    assert len(names) == len(set(names)) == 14  # per block 2 norms + 4 linears; ln_f, head
    assert "head" in names and "emb" not in names
    assert type(model.blocks[1].qkv) is nn.Linear and type(model.blocks[0].qkv) is fp8state.Linear
    assert fp8state.plan_conversion(model, module_filter_fn=keep)["blocks.1.qkv"].action == (
        "filtered"
    )


def test_a_shared_module_becomes_one_new_module_everywhere() -> None:
    shared = nn.Linear(16, 16)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    convert_quietly(model)
    assert type(model[0]) is fp8state.Linear and model[0] is model[2]
    assert model[0].weight is shared.weight
    assert [d.name for d in fp8state.plan_conversion(nn.Sequential(shared, shared))] == ["0"]


def test_converting_twice_changes_nothing_the_second_time() -> None:
    model = convert_quietly(tiny_lm())
    modules = dict(model.named_modules())
    assert len(fp8state.plan_conversion(model)) == 0
    convert_quietly(model)
    assert dict(model.named_modules()) == modules


def test_a_bare_linear_is_returned_converted() -> None:
    linear = nn.Linear(16, 32)
    converted = convert_quietly(linear)
    assert type(converted) is fp8state.Linear and converted.weight is linear.weight
    assert converted.bias is linear.bias


@pytest.mark.parametrize(
    ("norm", "target"),
    [(nn.LayerNorm(16), fp8state.LayerNorm), (nn.RMSNorm(16, eps=1e-6), fp8state.RMSNorm)],
)
def test_a_bare_norm_is_returned_converted(norm: nn.Module, target: type) -> None:
    converted = convert_quietly(norm)
    assert converted is not norm and type(converted) is target
    assert converted.weight is norm.weight


def test_on_unsupported_raise_starts_with_the_module_and_its_reason() -> None:
    with pytest.raises(ConversionError) as info:
        fp8state.convert_model(nn.Sequential(nn.Linear(10, 12)), on_unsupported="raise")
    message = str(info.value)
    assert message.startswith(
        "0: found a torch.nn.Linear that cannot be converted: "
        "in_features=10 and out_features=12 are not positive multiples"
    )
    assert message.count("torch._scaled_mm needs") == 1  # the reason once per module
    model = nn.Sequential(nn.Linear(10, 16), nn.Linear(16, 12))
    with pytest.raises(ConversionError) as info:
        fp8state.convert_model(model, on_unsupported="raise")
    lines = str(info.value).splitlines()
    assert lines[0].startswith("0: a torch.nn.Linear that cannot be converted: in_features=10")
    assert lines[1].startswith("1: a torch.nn.Linear that cannot be converted: out_features=12")
    assert lines[2].startswith("Expected modules fp8state's FP8 modules can stand in for.")
    assert info.value.key == "0, 1"


def test_module_filter_fn_with_the_wrong_signature_is_a_config_error() -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ConfigError) as info:
        fp8state.convert_model(model, module_filter_fn=lambda module: True)  # type: ignore[arg-type, misc]
    assert "fn(module, fqn) -> bool" in info.value.expected
    assert "(module)" in info.value.found
    assert type(model[0]) is nn.Linear

    def broken(module: nn.Module, fqn: str) -> bool:
        raise TypeError("a bug inside the filter")

    with pytest.raises(TypeError, match="a bug inside the filter"):  # not hidden as a ConfigError
        fp8state.convert_model(model, module_filter_fn=broken)


def test_report_types_are_public_in_fp8state_convert() -> None:
    import fp8state.convert as convert

    for name in ("ConversionReport", "ModuleDecision", "PairDecision", "FusedFrom"):
        assert name in convert.__all__
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    report = fp8state.plan_conversion(model, layernorm_linear=[("0", "1")])
    assert isinstance(report, convert.ConversionReport)
    assert isinstance(report["0"], convert.ModuleDecision)
    assert isinstance(report.pairs[0], convert.PairDecision)
    convert_quietly(model, layernorm_linear=[("0", "1")])
    assert model[1].fp8_fused_from == convert.FusedFrom(norm="0", linear="1")


def test_plan_conversion_changes_nothing_and_prints_a_table() -> None:
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 10))
    before = list(model)
    report = fp8state.plan_conversion(model)
    assert list(model) == before
    assert [(d.name, d.action, d.target) for d in report] == [
        ("0", "convert", "fp8state.LayerNorm"),
        ("1", "unsupported", ""),
    ]
    assert [d.name for d in report.swapped()] == ["0"]
    lines = str(report).splitlines()
    assert lines[0].split() == ["module", "type", "action", "becomes", "/", "reason"]
    assert lines[1].split()[:4] == ["0", "torch.nn.LayerNorm", "convert", "fp8state.LayerNorm"]
    assert "out_features=10" in lines[2]
    with pytest.raises(KeyError):
        report["2"]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"on_unsupported": "ignore"}, "on_unsupported"),
        ({"module_filter_fn": "head"}, "module_filter_fn"),
        ({"layernorm_linear": "0,1"}, "layernorm_linear"),
        ({"layernorm_linear": [("0", "1", "2")]}, "layernorm_linear"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, object], key: str) -> None:
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    with pytest.raises(ConfigError) as info:
        fp8state.convert_model(model, **kwargs)  # type: ignore[arg-type]
    assert info.value.key == key
    assert type(model[1]) is nn.Linear
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        fp8state.convert_model("model")  # type: ignore[arg-type]
