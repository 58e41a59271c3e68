"""fp8state's ``torch.library`` operators, registered without ``custom_op``'s Python layers.

A compiled FP8 step calls several of fp8state's operators per GEMM
(:mod:`fp8state.functional._ops`), so their dispatch is the step's host time.
``torch.library.custom_op`` runs each call through Python layers for autograd,
``ADInplaceOrView`` and output aliasing checks (``python benchmarks/profile_step.py`` shows
them among a compiled step's costliest functions), where an operator defined with
``Library.define`` and implemented for ``CompositeExplicitAutograd`` goes straight from the
dispatcher to its implementation. None of those layers does anything for these operators:
none is differentiated (an autograd Function around them is), none returns an alias of an
argument, and their one mutated argument is an ordering token. So they are defined here with
the low-level API, and their fake implementations registered as usual for tracing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["define"]

_LIB = torch.library.Library("fp8state", "DEF")


def define(
    name: str,
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    tags: Sequence[torch.Tag] = (),
) -> Any:
    """Define ``fp8state::name`` with ``schema``, run as ``impl``, traced as ``fake``.

    Args:
        name: The operator's name in the ``fp8state`` namespace.
        schema: Its arguments and returns, ``"(Tensor x, ...) -> Tensor"``.
        impl: The implementation, for every device; run as it is, never traced by Dynamo.
        fake: What it returns for fake tensors (shapes and dtypes only).
        tags: ``torch.Tag`` values of the operator.

    Returns:
        The operator's overload, ``torch.ops.fp8state.<name>.default``, to call.
    """
    _LIB.define(name + schema, tags=tuple(tags))
    _LIB.impl(name, torch.compiler.disable(impl), "CompositeExplicitAutograd")
    torch.library.register_fake(f"fp8state::{name}", fake, lib=_LIB)
    return getattr(torch.ops.fp8state, name).default
