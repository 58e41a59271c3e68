"""Every forward of a model under ``fp8_autocast``, for loops that call ``model(...)`` themselves.

Hugging Face's ``Trainer``, Accelerate and many hand-written loops call the model in code the
user does not own, so there is no place to write ``with fp8state.fp8_autocast():``.
:func:`autocast_forward` puts it around the model's ``forward`` instead, as Accelerate does for
TransformerEngine: each call enters a new ``fp8_autocast`` with the given recipe, and the
forward scales update when that call returns (the backward ones when its backward ends).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from fp8state.autocast import fp8_autocast
from fp8state.errors import ConfigError
from fp8state.recipe import DelayedScaling

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed import ProcessGroup

__all__ = ["autocast_forward", "remove_autocast_forward"]

# The instance attribute holding the settings; its presence marks a wrapped module.
_SETTINGS = "_fp8state_autocast_forward"


@dataclass
class _Settings:
    # The forward that was there before: a bound method of the module, so copy.deepcopy of
    # the module rebinds it to the copy (a closure over the module would call the original).
    inner: Callable[..., Any]
    recipe: DelayedScaling | None
    group: ProcessGroup | None
    gemm_backend: str
    during_eval: bool


def _call_under_autocast(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    settings: _Settings = module.__dict__[_SETTINGS]
    with fp8_autocast(
        enabled=settings.during_eval or module.training,
        fp8_recipe=settings.recipe,
        fp8_group=settings.group,
        gemm_backend=settings.gemm_backend,
    ):
        return settings.inner(*args, **kwargs)


def autocast_forward(
    module: nn.Module,
    *,
    fp8_recipe: DelayedScaling | None = None,
    fp8_group: ProcessGroup | None = None,
    gemm_backend: str = "auto",
    during_eval: bool = True,
) -> nn.Module:
    """Run every call of ``module`` under a new ``fp8_autocast`` with these arguments.

    The wrapper keeps the forward's signature (``Trainer`` reads it to pick dataset columns),
    adds nothing to the state dict, and follows ``copy.deepcopy`` of the module. Outside
    training (``module.eval()``) with ``during_eval=False`` the forward runs in high precision.

    Args:
        module: Usually a model after :func:`fp8state.convert_model`.
        fp8_recipe: As in :class:`fp8state.fp8_autocast`.
        fp8_group: As in :class:`fp8state.fp8_autocast`.
        gemm_backend: As in :class:`fp8state.fp8_autocast`.
        during_eval: Also compute in FP8 while ``module.training`` is False.

    Returns:
        ``module`` itself.

    Raises:
        ConfigError: an argument ``fp8_autocast`` refuses, or ``module`` is wrapped already
            (call :func:`remove_autocast_forward` first to change the arguments).

    Example:
        >>> import torch, fp8state
        >>> from fp8state.integrations.forward import autocast_forward
        >>> model = autocast_forward(fp8state.convert_model(torch.nn.Linear(16, 16)))
        >>> model.fp8_min_gemm_macs = 0  # FP8 even at this toy size
        >>> _ = model(torch.randn(4, 16))  # no `with fp8_autocast()` needed
        >>> model.fp8_last_gemm_backend  # on a CPU; "scaled_mm" on an FP8-capable GPU
        'emulated'
    """
    fp8_autocast(fp8_recipe=fp8_recipe, fp8_group=fp8_group, gemm_backend=gemm_backend)
    if _SETTINGS in module.__dict__:
        raise ConfigError(
            f"autocast_forward({type(module).__name__})",
            "a module whose forward already runs under fp8_autocast",
            "a module not wrapped yet",
            "Call fp8state.integrations.forward.remove_autocast_forward(module) first.",
        )
    inner = module.forward

    # A new function per module, to carry that module's signature; it closes over nothing,
    # bound as a method below, so a deep copy of the module calls the copy.
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _call_under_autocast(self, args, kwargs)

    signature = inspect.signature(inner)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[this, *signature.parameters.values()]
    )
    forward.__doc__ = inner.__doc__
    module.__dict__[_SETTINGS] = _Settings(
        inner, fp8_recipe, fp8_group, gemm_backend, bool(during_eval)
    )
    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    return module


def remove_autocast_forward(module: nn.Module) -> nn.Module:
    """Undo :func:`autocast_forward`: ``module`` calls the forward it had before.

    Args:
        module: A module :func:`autocast_forward` wrapped.

    Returns:
        ``module`` itself.

    Raises:
        ConfigError: ``module`` is not wrapped.
    """
    settings = module.__dict__.pop(_SETTINGS, None)
    if settings is None:
        raise ConfigError(
            f"remove_autocast_forward({type(module).__name__})",
            "a module whose forward is not wrapped",
            "a module autocast_forward wrapped",
            "Nothing to undo; leave the module as it is.",
        )
    del module.__dict__["forward"]
    inner = settings.inner
    class_forward = getattr(inner, "__self__", None) is module and (
        getattr(inner, "__func__", None) is type(module).forward
    )
    if not class_forward:  # a forward another wrapper had put on the instance
        module.forward = inner  # type: ignore[method-assign]
    return module
