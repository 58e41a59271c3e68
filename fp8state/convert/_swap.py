"""Swap a model's ``torch.nn`` layers for fp8state modules in place, keeping every Parameter.

:func:`convert_model` replaces each ``nn.Linear`` by an :class:`fp8state.Linear`, each
``nn.LayerNorm`` / ``nn.RMSNorm`` by :class:`fp8state.LayerNorm` / :class:`fp8state.RMSNorm`,
each Hugging Face ``Conv1D`` by an ``fp8state.Conv1D``, and, where asked, a norm feeding one
linear layer by a :class:`fp8state.LayerNormLinear` (the norm's slot becomes ``nn.Identity``).
:func:`plan_conversion` says what it would do, module by module, without changing anything;
modules that look like linear layers without being of a type it knows are reported too
(``_lookalike``). The rules (exact types only, and why) are in :mod:`fp8state.convert._rules`;
``docs/interop.md`` is the user's guide.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from fp8state.convert import _rules as rules
from fp8state.convert._build import FusedFrom, build_fused, build_swap, is_fused_pair
from fp8state.convert._checks import ON_UNSUPPORTED, check_arguments
from fp8state.convert._lookalike import lookalike_reason
from fp8state.convert._report import (
    PROBLEM_ACTIONS,
    ConversionReport,
    ModuleDecision,
    PairDecision,
)
from fp8state.errors import ConfigError, ConversionError

__all__ = ["convert_model", "plan_conversion"]

ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass
class _Pair:
    norm_name: str
    linear_name: str
    norm: nn.Module
    linear: nn.Module


@dataclass
class _Plan:
    report: ConversionReport
    swaps: list[nn.Module] = field(default_factory=list)  # modules replaced one for one
    fused: list[_Pair] = field(default_factory=list)


def _named_pairs(lookup: dict[str, nn.Module], names: list[tuple[str, str]]) -> list[_Pair]:
    """Resolve the user's pairs; a name that is wrong is an error whatever on_unsupported says."""
    pairs: list[_Pair] = []
    used: dict[int, tuple[str, str]] = {}
    for norm_name, linear_name in names:
        for name in (norm_name, linear_name):
            if name not in lookup:
                raise ConversionError(
                    name,
                    "no module of that name in the model",
                    "a name from model.named_modules()",
                    "Check the layernorm_linear pair "
                    f"({norm_name!r}, {linear_name!r}) against print(model).",
                )
        norm, linear = lookup[norm_name], lookup[linear_name]
        if is_fused_pair(norm, linear, FusedFrom(norm=norm_name, linear=linear_name)):
            continue  # fused by an earlier conversion: converting again changes nothing
        problem = rules.pair_problem(norm, linear, norm_name, linear_name)
        if problem is not None:
            swapped = rules.pair_problem(linear, norm) is None
            raise ConversionError(
                f"({norm_name}, {linear_name})",
                problem,
                "a (norm name, linear name) pair: exactly an nn.LayerNorm or nn.RMSNorm, then "
                "exactly the nn.Linear its output feeds, normalizing its input features",
                f"Name the norm first: layernorm_linear=[({linear_name!r}, {norm_name!r})]."
                if swapped
                else "Name only norm -> linear pairs of matching size in layernorm_linear.",
            )
        for name, module in ((norm_name, norm), (linear_name, linear)):
            if id(module) in used:
                raise ConversionError(
                    name,
                    f"a module already named in the pair {used[id(module)]}",
                    "each module in at most one layernorm_linear pair",
                    "A norm feeding several linear layers cannot be fused; name one pair "
                    "per norm, or none.",
                )
            used[id(module)] = (norm_name, linear_name)
        pairs.append(_Pair(norm_name, linear_name, norm, linear))
    return pairs


def _sequential_pairs(model: nn.Module, taken: set[int]) -> list[_Pair]:
    """Adjacent norm -> nn.Linear children of every (exact) nn.Sequential."""
    pairs = []
    for seq_name, seq in model.named_modules():
        if type(seq) is not nn.Sequential:  # a subclass may not run its children in order
            continue
        children = list(seq._modules.items())
        for (n_key, norm), (l_key, linear) in zip(children, children[1:], strict=False):
            if norm is None or linear is None or id(norm) in taken or id(linear) in taken:
                continue
            if rules.pair_problem(norm, linear) is not None:
                continue
            prefix = f"{seq_name}." if seq_name else ""
            pairs.append(_Pair(prefix + n_key, prefix + l_key, norm, linear))
            taken.update((id(norm), id(linear)))
    return pairs


def _plan(
    model: nn.Module,
    module_filter_fn: ModuleFilter | None,
    layernorm_linear: Iterable[tuple[str, str]],
    layernorm_linear_sequential: bool,
) -> _Plan:
    names = check_arguments(model, module_filter_fn, layernorm_linear)
    paths: dict[int, list[str]] = {}
    lookup: dict[str, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(name)
        lookup[name] = module
    pairs = _named_pairs(lookup, names)
    if layernorm_linear_sequential:
        taken = {id(m) for p in pairs for m in (p.norm, p.linear)}
        pairs += _sequential_pairs(model, taken)

    keep: dict[int, bool] = {}  # the filter's answer, asked once per module

    def wanted(module: nn.Module) -> bool:
        if id(module) not in keep:
            first = paths[id(module)][0]
            keep[id(module)] = module_filter_fn is None or bool(module_filter_fn(module, first))
        return keep[id(module)]

    plan = _Plan(ConversionReport(()))
    pair_decisions, fused_role = [], {}
    for pair in pairs:
        members = ((pair.norm_name, pair.norm), (pair.linear_name, pair.linear))
        excluded = [name for name, m in members if not wanted(m)]
        problems = [f"{name}: {p}" for name, m in members for p in rules.module_problems(m)]
        problems += [
            f"{name} is reachable under {len(paths[id(m)])} names "
            f"({', '.join(paths[id(m)])}); a shared module cannot be fused"
            for name, m in members
            if len(paths[id(m)]) > 1
        ]
        if excluded:
            reason = f"module_filter_fn excluded {', '.join(excluded)}"
            pair_decisions.append(
                PairDecision(pair.norm_name, pair.linear_name, False, reason, filtered=True)
            )
        elif problems:
            pair_decisions.append(
                PairDecision(pair.norm_name, pair.linear_name, False, "; ".join(problems))
            )
        else:
            pair_decisions.append(PairDecision(pair.norm_name, pair.linear_name, True))
            plan.fused.append(pair)
            fused_role[id(pair.norm)] = (
                "torch.nn.Identity",
                f"fused into {pair.linear_name} (fp8state.LayerNormLinear)",
            )
            fused_role[id(pair.linear)] = (
                "fp8state.LayerNormLinear",
                f"fused with the norm {pair.norm_name}",
            )

    decisions = []
    for name, module in model.named_modules():  # each module once, under its first name
        kind = rules.type_name(module)
        if not rules.is_candidate(module):
            lookalike = lookalike_reason(module, kind)
            if lookalike is None:
                continue
            if wanted(module):
                decisions.append(ModuleDecision(name, kind, "unrecognized", "", lookalike))
            else:
                decisions.append(
                    ModuleDecision(name, kind, "filtered", "", "module_filter_fn returned False")
                )
        elif id(module) in fused_role:
            target, reason = fused_role[id(module)]
            decisions.append(ModuleDecision(name, kind, "fuse", target, reason))
        elif not rules.is_swappable_type(module):
            decisions.append(
                ModuleDecision(name, kind, "subclass", "", rules.subclass_reason(module))
            )
        elif not wanted(module):
            decisions.append(
                ModuleDecision(name, kind, "filtered", "", "module_filter_fn returned False")
            )
        elif problems := rules.module_problems(module):
            decisions.append(ModuleDecision(name, kind, "unsupported", "", "; ".join(problems)))
        else:
            target = rules.target_name(module)
            decisions.append(
                ModuleDecision(
                    name, kind, "convert", target, f"becomes {target} with the same Parameters"
                )
            )
            plan.swaps.append(module)
    plan.report = ConversionReport(tuple(decisions), tuple(pair_decisions))
    return plan


def _unsupported_error(report: ConversionReport) -> ConversionError:
    """``on_unsupported="raise"``: each module (or pair) by name first, then its reason."""
    failed = [
        (d.name, f"a {d.module_type} that cannot be converted: {d.reason}")
        for d in report
        if d.action in PROBLEM_ACTIONS
    ]
    failed += [
        (f"({p.norm}, {p.linear})", f"a pair that cannot be fused: {p.reason}")
        for p in report.pairs
        if not p.fused and not p.filtered
    ]
    names = [name for name, _ in failed]
    key = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
    if len(failed) == 1:
        found = failed[0][1]
    else:
        found = f"{len(failed)} modules or pairs that cannot be converted"
    err = ConversionError(
        key,
        found,
        "modules fp8state's FP8 modules can stand in for",
        "Nothing was changed. Exclude them with module_filter_fn (it gets the module and "
        "its name), or pass on_unsupported='skip' to leave them in high precision.",
    )
    if len(failed) > 1:  # one line per module, each starting with its name, then the advice
        err.found = "\n".join(f"{name}: {reason}" for name, reason in failed)
        err.args = (f"{err.found}\nExpected {err.expected}. {err.fix}",)
    return err


def plan_conversion(
    model: nn.Module,
    *,
    module_filter_fn: ModuleFilter | None = None,
    layernorm_linear: Iterable[tuple[str, str]] = (),
    layernorm_linear_sequential: bool = False,
) -> ConversionReport:
    """What :func:`convert_model` would do with these arguments; the model is not changed.

    Returns:
        One :class:`ModuleDecision` per ``nn.Linear`` / ``nn.LayerNorm`` / ``nn.RMSNorm`` /
        Hugging Face ``Conv1D`` (subclasses included), one per module that looks like a linear
        layer of a type convert_model does not know (``"unrecognized"``), and one
        :class:`PairDecision` per norm + linear pair asked for.

    Raises:
        ConfigError: an argument of the wrong kind.
        ConversionError: a ``layernorm_linear`` pair names no module, a module of the wrong
            type or size, or a module already in another pair.

    Example:
        >>> import torch, fp8state
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 10))
        >>> report = fp8state.plan_conversion(model)
        >>> [(d.name, d.action) for d in report]
        [('0', 'convert'), ('1', 'unsupported')]
        >>> report["1"].reason.split(" (")[0]
        'out_features=10 is not a positive multiple of 16'
    """
    return _plan(model, module_filter_fn, layernorm_linear, layernorm_linear_sequential).report


def convert_model(
    model: nn.Module,
    *,
    module_filter_fn: ModuleFilter | None = None,
    layernorm_linear: Iterable[tuple[str, str]] = (),
    layernorm_linear_sequential: bool = False,
    on_unsupported: Literal["skip", "raise"] = "skip",
) -> nn.Module:
    """Swap ``nn.Linear`` / ``nn.LayerNorm`` / ``nn.RMSNorm`` for fp8state modules, in place.

    1. Every module of exactly one of those types, or exactly Hugging Face's ``Conv1D``
       (``transformers.pytorch_utils.Conv1D``, GPT-2's layers: it becomes an
       ``fp8state.Conv1D``, keeping the ``(in, out)`` weight layout and names), for which
       ``module_filter_fn(module, name)`` is True is replaced by its fp8state counterpart
       holding the very same ``nn.Parameter`` objects: optimizers, tied weights,
       ``requires_grad``, devices and dtypes stay valid. Subclasses are never swapped: they
       may compute differently. The training mode is kept; FP8 metadata starts as a fresh
       module's, on the weight's device (``meta`` for a model on ``meta``). A module
       reachable under several names is replaced everywhere by one new module.
    2. Each pair in ``layernorm_linear`` (and, with ``layernorm_linear_sequential``, each norm
       directly followed by an ``nn.Linear`` in an ``nn.Sequential``) becomes one
       ``fp8state.LayerNormLinear`` in the linear layer's place, and the norm's place becomes
       ``nn.Identity``. Only name a pair whose norm output feeds that linear layer and nothing
       else: the model's own code is not analysed. The fused module records the original
       names in ``module.fp8_fused_from`` (:class:`FusedFrom`), so plain checkpoints keep
       loading and exporting under them (``fp8state.checkpoint.load_plain_state_dict``,
       ``to_plain_state_dict``).
    3. A module of a swappable type that cannot be swapped (see :func:`plan_conversion`: a
       GEMM size ``torch._scaled_mm`` cannot take, hooks the swap would drop, a norm
       fp8state's cannot express...) stays as it is, with one warning listing each one and
       why; so does a module of no type convert_model knows that looks like a linear layer
       (a 2-D weight with ``in_features``/``out_features``, or a class name saying so). With
       ``on_unsupported="raise"`` either is an error instead and nothing changes.

    Outside ``fp8_autocast`` the converted model computes exactly what the original did, bit
    for bit. Converting twice changes nothing the second time.

    Args:
        model: The model, unwrapped (convert before DDP, FSDP2 or ``torch.compile``).
        module_filter_fn: ``fn(module, fqn) -> bool``: False leaves that module as it is
            (torchao's convention). Asked once per candidate module (and per module that
            looks like a linear layer), with its first name.
            A callable that cannot take those two arguments is a ``ConfigError``.
        layernorm_linear: ``(norm name, linear name)`` pairs to fuse.
        layernorm_linear_sequential: Also fuse adjacent norm -> linear children of
            ``nn.Sequential`` containers.
        on_unsupported: ``"skip"`` (warn and leave) or ``"raise"``.

    Returns:
        ``model``, converted; the new module when ``model`` itself was an ``nn.Linear`` or a
        norm.

    Raises:
        ConversionError: with ``on_unsupported="raise"``, naming every module that cannot be
            converted and why; or a wrong ``layernorm_linear`` pair. The model is unchanged.
        ConfigError: an argument of the wrong kind.

    Example:
        >>> import torch, fp8state
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 64))
        >>> weight = model[1].weight
        >>> model = fp8state.convert_model(model, layernorm_linear_sequential=True)
        >>> [type(m).__name__ for m in model]
        ['Identity', 'LayerNormLinear']
        >>> model[1].weight is weight
        True
    """
    if on_unsupported not in ON_UNSUPPORTED:
        raise ConfigError(
            "on_unsupported",
            repr(on_unsupported),
            f"one of {ON_UNSUPPORTED}",
            "Pass 'skip' to leave such modules in high precision, or 'raise'.",
        )
    plan = _plan(model, module_filter_fn, layernorm_linear, layernorm_linear_sequential)
    problems = plan.report.problems()
    if problems and on_unsupported == "raise":
        raise _unsupported_error(plan.report)
    # Build everything before the first swap, so a failure leaves the model as it was.
    replacement: dict[int, nn.Module] = {id(m): build_swap(m) for m in plan.swaps}
    for pair in plan.fused:
        assert isinstance(pair.norm, nn.LayerNorm | nn.RMSNorm)
        assert isinstance(pair.linear, nn.Linear)
        names = FusedFrom(norm=pair.norm_name, linear=pair.linear_name)
        replacement[id(pair.linear)] = build_fused(pair.norm, pair.linear, names)
        replacement[id(pair.norm)] = nn.Identity().train(pair.norm.training)
    edges = [
        (parent, attr, replacement[id(child)])
        for _, parent in model.named_modules(remove_duplicate=False)
        for attr, child in parent._modules.items()
        if child is not None and id(child) in replacement
    ]
    for parent, attr, new in edges:
        setattr(parent, attr, new)
    if problems:
        warnings.warn(
            f"convert_model left {len(problems)} module(s) or pair(s) as they were:\n"
            + "\n".join(f"  - {line}" for line in problems)
            + "\nExclude them with module_filter_fn to silence this, or see "
            "fp8state.plan_conversion(model).",
            UserWarning,
            stacklevel=2,
        )
    return replacement.get(id(model), model)
