"""The argument checks of :func:`fp8state.convert_model` and :func:`fp8state.plan_conversion`."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from torch import nn

from fp8state.errors import ConfigError

__all__ = ["check_arguments", "check_filter", "ON_UNSUPPORTED"]

ON_UNSUPPORTED = ("skip", "raise")


def check_arguments(
    model: object, module_filter_fn: object, layernorm_linear: object
) -> list[tuple[str, str]]:
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "convert_model(model)",
            f"a {type(model).__name__}",
            "a torch.nn.Module",
            "Pass the model itself.",
        )
    if module_filter_fn is not None:
        check_filter(module_filter_fn)
    if isinstance(layernorm_linear, str) or not isinstance(layernorm_linear, Iterable):
        raise ConfigError(
            "layernorm_linear",
            repr(layernorm_linear),
            "an iterable of (norm, linear) names",
            "Pass e.g. [('blocks.0.ln_2', 'blocks.0.mlp.fc1')].",
        )
    pairs = list(layernorm_linear)
    for pair in pairs:
        if not (
            isinstance(pair, tuple | list)
            and len(pair) == 2
            and all(isinstance(n, str) for n in pair)
        ):
            raise ConfigError(
                "layernorm_linear",
                f"the item {pair!r}",
                "a (norm name, linear name) pair",
                "Name each pair as two strings, as model.named_modules() spells them.",
            )
    return [(str(a), str(b)) for a, b in pairs]


def check_filter(module_filter_fn: object) -> None:
    """A ConfigError unless ``module_filter_fn`` can be called as ``fn(module, fqn)``."""
    fix = "Pass a function such as lambda module, fqn: not fqn.startswith('head')."
    if not callable(module_filter_fn):
        raise ConfigError(
            "module_filter_fn",
            f"a {type(module_filter_fn).__name__}",
            "a callable fn(module, fqn) -> bool, or None",
            fix,
        )
    try:
        signature = inspect.signature(module_filter_fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(nn.Identity(), "name")
    except TypeError:
        name = getattr(module_filter_fn, "__qualname__", type(module_filter_fn).__name__)
        raise ConfigError(
            "module_filter_fn",
            f"{name}{signature}, which cannot take (module, fqn)",
            "a callable fn(module, fqn) -> bool: the module, then its name as "
            "model.named_modules() spells it",
            fix,
        ) from None
