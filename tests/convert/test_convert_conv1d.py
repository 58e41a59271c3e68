"""convert_model on GPT-2 (Hugging Face's Conv1D), on modules that only look like linear layers,
and a second conversion."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
from _helpers.numerics import sqnr
from _helpers.paths import REPO_ROOT
from _helpers.tiny_lm import convert_quietly
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D as HFConv1D

import fp8state
from fp8state.errors import ConversionError
from fp8state.modules.conv1d import Conv1D

VOCAB, POSITIONS = 128, 32


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        bos_token_id=0,  # GPT-2's 50256 is outside a 128-token vocabulary
        eos_token_id=0,
        resid_pdrop=0.0,  # no dropout: outputs are a function of the weights alone
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def batch(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 16), generator=gen)


def conv1d_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is HFConv1D]


def test_every_conv1d_and_linear_of_gpt2_is_converted_and_reported() -> None:
    model = gpt2()
    names = conv1d_names(model)
    assert len(names) == 8  # c_attn, c_proj, c_fc, mlp.c_proj in each of 2 blocks
    report = fp8state.plan_conversion(model)
    assert report.problems() == []
    for name in names:
        decision = report[name]
        assert decision.module_type == "transformers.pytorch_utils.Conv1D"
        assert (decision.action, decision.target) == ("convert", "fp8state.Conv1D")
    assert report["lm_head"].action == "convert"
    assert {d.action for d in report} == {"convert"}
    convert_quietly(model)  # no warning: nothing is left behind
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert all(kinds[name] is Conv1D for name in names)
    assert kinds["lm_head"] is fp8state.Linear
    assert kinds["transformer.h.0.ln_1"] is fp8state.LayerNorm
    assert not any(type(m) is HFConv1D or type(m) is nn.Linear for m in model.modules())
    c_attn = model.transformer.h[0].attn.c_attn
    assert (c_attn.nf, c_attn.nx, c_attn.in_features, c_attn.out_features) == (192, 64, 64, 192)
    # Converting again finds nothing to do, and no fp8state module looks "unrecognized".
    assert len(fp8state.plan_conversion(model)) == 0


def test_parameters_stay_the_same_objects_and_keep_their_layout() -> None:
    model = gpt2()
    before = dict(model.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_quietly(model)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives
    assert tuple(model.transformer.h[0].mlp.c_fc.weight.shape) == (64, 256)  # (in, out)
    old = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    model(batch(), labels=batch()).loss.backward()
    optimizer.step()  # the optimizer built before the conversion trains the converted model
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight, old)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_outside_fp8_autocast_outputs_and_gradients_are_bit_for_bit_the_same(
    train: bool,
) -> None:
    plain = gpt2().train(train)
    model = convert_quietly(copy.deepcopy(plain))
    tokens = batch()
    out_plain, out = plain(tokens, labels=tokens), model(tokens, labels=tokens)
    assert torch.equal(out.logits, out_plain.logits)
    assert torch.equal(out.loss, out_plain.loss)
    out.loss.backward()
    out_plain.loss.backward()
    grads_plain = {n: p.grad for n, p in plain.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads_plain[name]), name


def test_inputs_of_any_rank_match_transformers_conv1d() -> None:
    torch.manual_seed(0)
    plain = HFConv1D(48, 32)
    nn.init.normal_(plain.bias)
    layer = fp8state.convert_model(copy.deepcopy(plain))
    assert type(layer) is Conv1D and layer.weight.shape == plain.weight.shape
    for shape in [(5, 32), (2, 5, 32), (2, 3, 4, 32)]:
        x = torch.randn(shape)
        assert torch.equal(layer(x), plain(x)), shape
    # Under fp8_autocast, a GEMM too small for FP8 runs in high precision: exactly as well.
    layer.fp8_min_gemm_macs = 10**9
    with fp8state.fp8_autocast():
        out = layer(x)
    assert layer.fp8_last_gemm_backend == "high_precision"
    assert torch.equal(out, plain(x))


def test_state_dict_names_and_shapes_are_gpt2s() -> None:
    plain = gpt2()
    model = convert_quietly(copy.deepcopy(plain))
    plain_sd = plain.state_dict()
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in plain_sd.items()}
    exported = fp8state.checkpoint.to_plain_state_dict(model)
    assert list(exported) == list(plain_sd)
    assert all(torch.equal(exported[k], plain_sd[k]) for k in plain_sd)
    # The plain state dict loads back into a fresh conversion, which then computes the same.
    fresh = convert_quietly(gpt2(seed=1))
    fp8state.checkpoint.load_plain_state_dict(fresh, plain_sd)
    assert torch.equal(fresh(batch()).logits, plain(batch()).logits)


def test_save_pretrained_weight_names_are_unchanged_and_load_both_ways(tmp_path: Path) -> None:
    plain = gpt2()
    model = convert_quietly(copy.deepcopy(plain))
    plain.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "fp8")
    plain_file = safetensors.torch.load_file(tmp_path / "plain" / "model.safetensors")
    fp8_file = safetensors.torch.load_file(tmp_path / "fp8" / "model.safetensors")
    fp8_weights = {k: v for k, v in fp8_file.items() if not k.endswith("._extra_state")}
    assert {k: v.shape for k, v in fp8_weights.items()} == {
        k: v.shape for k, v in plain_file.items()
    }
    # A GPT-2 checkpoint loads into the converted model.
    fresh = convert_quietly(gpt2(seed=1))
    fp8state.checkpoint.load_safetensors(fresh, tmp_path / "plain" / "model.safetensors")
    assert torch.equal(fresh(batch()).logits, plain(batch()).logits)
    # And fp8state's export loads into plain GPT-2 with Hugging Face's own loader.
    fp8state.checkpoint.save_safetensors(model, tmp_path / "export.safetensors")
    back = gpt2(seed=2)
    safetensors.torch.load_model(back, tmp_path / "export.safetensors")
    assert torch.equal(back(batch()).logits, plain(batch()).logits)


def _fp8_ready(model: nn.Module) -> list[fp8state.FP8StateMixin]:
    modules = [m for m in model.modules() if isinstance(m, fp8state.FP8StateMixin)]
    for module in modules:
        module.fp8_min_gemm_macs = 0  # these GEMMs are far too small to pay otherwise
    return modules


def test_converted_gpt2_trains_in_fp8() -> None:
    plain = gpt2()
    model = convert_quietly(copy.deepcopy(plain))
    modules = _fp8_ready(model)
    tokens = batch()
    with fp8state.fp8_autocast():
        first = model(tokens, labels=tokens)
    assert sqnr(plain(tokens).logits, first.logits) > 20  # FP8, yet close to the original
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        with fp8state.fp8_autocast():
            loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1
    convs = [m for m in modules if isinstance(m, Conv1D)]
    assert len(convs) == 8 and len(modules) == 9  # 8 Conv1D + lm_head
    for module in modules:
        assert module.fp8_last_gemm_backend == "emulated"  # FP8, not the high-precision path
        fwd, bwd = module.fp8_meta("fwd"), module.fp8_meta("bwd")
        # One history row per step: 7 forward passes (input, weight), 6 backward (gradient).
        assert (fwd.amax_history[:, :2] > 0).sum(dim=0).tolist() == [7, 7]
        assert int((bwd.amax_history[:, 0] > 0).sum()) == 6
        assert not torch.equal(fwd.scale[:2], torch.ones(2))  # the scales moved


def test_fp8_conv1d_is_fp8_linear_on_the_transposed_weight_bit_for_bit() -> None:
    torch.manual_seed(0)
    conv = Conv1D(48, 32)
    nn.init.normal_(conv.bias)
    linear = fp8state.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    x = torch.randn(2, 5, 32)
    outs = []
    for module in (conv, linear):
        module.fp8_min_gemm_macs = 0
        inp = x.clone().requires_grad_()
        for _ in range(2):  # the second step runs on scales the first one set
            with fp8state.fp8_autocast():
                out = module(inp)
            out.square().sum().backward()
        outs.append((out, inp.grad, module.weight.grad, module.bias.grad))
    (out_c, dx_c, dw_c, db_c), (out_l, dx_l, dw_l, db_l) = outs
    assert torch.equal(out_c, out_l) and torch.equal(dx_c, dx_l) and torch.equal(db_c, db_l)
    assert torch.equal(dw_c, dw_l.t())
    assert dw_c.shape == conv.weight.shape and dw_c.is_contiguous()
    for direction in ("fwd", "bwd"):
        for a, b in zip(conv.fp8_meta(direction), linear.fp8_meta(direction), strict=True):
            assert torch.equal(a, b), direction


def test_conv1d_sizes_fp8_cannot_take_stay_with_a_warning_and_subclasses_stay_quietly() -> None:
    class GatedConv1D(HFConv1D):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(super().forward(x))

    model = nn.Sequential(HFConv1D(10, 64), HFConv1D(64, 64), GatedConv1D(64, 64))
    report = fp8state.plan_conversion(model)
    assert report["0"].action == "unsupported"
    assert report["0"].reason.startswith("nf=10 is not a positive multiple of 16")
    assert report["2"].action == "subclass"
    assert "a subclass of transformers.pytorch_utils.Conv1D" in report["2"].reason
    with pytest.warns(UserWarning) as record:
        fp8state.convert_model(model)
    assert len(record) == 1 and "1 module(s)" in str(record[0].message)
    assert "0 (transformers.pytorch_utils.Conv1D): nf=10" in str(record[0].message)
    assert [type(m) for m in model] == [HFConv1D, Conv1D, GatedConv1D]


class HandLinear(nn.Module):
    """A linear layer written by hand: convert_model cannot know what its forward does."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.randn(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def test_modules_that_look_like_linear_layers_are_reported_and_warned_about() -> None:
    # A copy of GPT-2's Conv1D in another package: the same name, not transformers' class.
    vendored = type("Conv1D", (nn.Module,), {"__module__": "some_package.layers"})
    lookalike_conv = vendored()
    lookalike_conv.weight = nn.Parameter(torch.randn(16, 32))
    model = nn.Sequential(
        HandLinear(16, 32), lookalike_conv, nn.Embedding(10, 16), nn.Linear(16, 16)
    )
    report = fp8state.plan_conversion(model)
    assert [d.name for d in report] == ["0", "1", "3"]  # the embedding is no lookalike
    assert report["0"].action == report["1"].action == "unrecognized"
    assert "in_features/out_features attributes" in report["0"].reason
    assert "the class name Conv1D" in report["1"].reason
    assert report["1"].module_type == "some_package.layers.Conv1D"
    assert "fp8state.functional.fp8_linear" in report["0"].reason
    with pytest.raises(ConversionError) as info:
        fp8state.convert_model(copy.deepcopy(model), on_unsupported="raise")
    assert info.value.key == "0, 1"
    with pytest.warns(UserWarning, match="2 module") as record:
        fp8state.convert_model(model)
    assert len(record) == 1
    assert f"0 ({__name__}.HandLinear): looks like a linear layer" in str(record[0].message)
    assert type(model[0]) is HandLinear and type(model[3]) is fp8state.Linear


def test_module_filter_fn_silences_a_lookalike() -> None:
    model = nn.Sequential(HandLinear(16, 32), nn.Linear(32, 32))
    asked: list[str] = []

    def keep(module: nn.Module, name: str) -> bool:
        asked.append(name)
        return name != "0"

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8state.convert_model(model, module_filter_fn=keep)
    assert asked == ["0", "1"]
    assert fp8state.plan_conversion(model, module_filter_fn=keep)["0"].action == "filtered"


def test_conv1d_is_recognized_without_importing_transformers() -> None:
    code = (
        "import sys, torch, fp8state\n"
        "fp8state.convert_model(torch.nn.Sequential(torch.nn.Linear(16, 16)))\n"
        "assert 'transformers' not in sys.modules, 'fp8state imported transformers'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=120)


def test_converting_twice_with_named_pairs_changes_nothing() -> None:
    # A training stack may convert the same model once per run (Lightning's setup does).
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 32))
    fp8state.convert_model(model, layernorm_linear=[("0", "1")])
    fused, params = model[1], list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = fp8state.convert_model(model, layernorm_linear=[("0", "1")])
    assert again is model and model[1] is fused
    assert [type(m) for m in model] == [nn.Identity, fp8state.LayerNormLinear, fp8state.Linear]
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    # A pair that was never fused still has to name a norm and a linear layer.
    with pytest.raises(ConversionError):
        fp8state.convert_model(model, layernorm_linear=[("0", "2")])
