"""Lightning precision plugins: convert the model with fp8state, run its steps in FP8.

In the manner of Lightning's ``TransformerEnginePrecision``: :class:`FabricFP8Precision` for
``Fabric(plugins=...)``, :class:`TrainerFP8Precision` for ``Trainer(plugins=...)``. Each converts
the model when Lightning sets it up (:func:`fp8state.convert_model`) and runs every forward
under :class:`fp8state.fp8_autocast` with its recipe. ``docs/lightning.md`` is the guide.

Importing this module imports ``lightning`` (the ``fp8state[lightning]`` extra);
``import fp8state`` never does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

from torch import nn

from fp8state.autocast import fp8_autocast
from fp8state.checkpoint import load_plain_state_dict, to_plain_state_dict
from fp8state.convert import convert_model
from fp8state.errors import CheckpointError, ConfigError
from fp8state.mixin import FP8StateMixin
from fp8state.recipe import DelayedScaling
from fp8state.schema import EXTRA_STATE_KEY

try:
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
except ImportError:
    raise ConfigError(
        "fp8state.integrations.lightning",
        "the lightning package is not installed",
        "lightning>=2.4",
        "Install it with `pip install fp8state[lightning]` (or `pip install lightning`).",
    ) from None

__all__ = ["FabricFP8Precision", "TrainerFP8Precision", "restore_fp8_checkpoint", "CHECKPOINT_KEY"]

#: Where :class:`TrainerFP8Precision` keeps the FP8 metadata in a Lightning checkpoint.
CHECKPOINT_KEY = "fp8state"

ModuleFilter = Callable[[nn.Module, str], bool]


class FabricFP8Precision(FabricPrecision):
    """FP8 training for ``Fabric``: ``fabric.setup`` converts the model, forwards run in FP8.

    - ``fabric.setup(model, ...)`` (and ``setup_module``) calls
      :func:`fp8state.convert_model` on the model with the convert options given here, in
      place: the Parameters stay the same objects, so an optimizer built before ``setup``
      stays valid. With ``convert=False`` the model is taken as it is (built with fp8state
      modules already).
    - Every forward of the set-up model (and ``fabric.autocast()``) runs under
      ``fp8_autocast(fp8_recipe=recipe)``; the forward scales update when it ends and the
      backward scales when ``fabric.backward`` ends, reduced over the default process group
      under DDP.
    - Parameters keep their dtype (the ``precision`` Lightning reports is ``"32-true"``: the
      weights are as you built them; FP8 is inside the GEMMs).

    Checkpoints need nothing more: ``fabric.save`` writes each FP8 module's metadata under its
    ``_extra_state`` key, and ``fabric.load`` into a set-up model restores it exactly.

    Args:
        recipe: The delayed-scaling recipe (default ``fp8state.DelayedScaling()``).
        convert: Convert the model at setup.
        module_filter_fn: As in :func:`fp8state.convert_model`.
        layernorm_linear: As in :func:`fp8state.convert_model`.
        layernorm_linear_sequential: As in :func:`fp8state.convert_model`.
        on_unsupported: As in :func:`fp8state.convert_model`.
        fp8_min_gemm_macs: When given, set on every FP8 module after conversion
            (:attr:`fp8state.FP8StateMixin.fp8_min_gemm_macs`; 0 runs every GEMM in FP8).
        gemm_backend: As in :class:`fp8state.fp8_autocast`.

    Raises:
        ConfigError: an argument of the wrong kind.
    """

    precision = "32-true"

    def __init__(
        self,
        *,
        recipe: DelayedScaling | None = None,
        convert: bool = True,
        module_filter_fn: ModuleFilter | None = None,
        layernorm_linear: Iterable[tuple[str, str]] = (),
        layernorm_linear_sequential: bool = False,
        on_unsupported: Literal["skip", "raise"] = "skip",
        fp8_min_gemm_macs: int | None = None,
        gemm_backend: str = "auto",
    ) -> None:
        fp8_autocast(fp8_recipe=recipe, gemm_backend=gemm_backend)  # checks both, enters nothing
        if fp8_min_gemm_macs is not None and (
            isinstance(fp8_min_gemm_macs, bool)
            or not isinstance(fp8_min_gemm_macs, int)
            or fp8_min_gemm_macs < 0
        ):
            raise ConfigError(
                f"{type(self).__name__}(fp8_min_gemm_macs=...)",
                repr(fp8_min_gemm_macs),
                "an int >= 0, or None for the backend's default",
                "Pass 0 to run every GEMM in FP8, or leave it out.",
            )
        self.recipe = recipe or DelayedScaling()
        self.convert = bool(convert)
        self.gemm_backend = gemm_backend
        self.fp8_min_gemm_macs = fp8_min_gemm_macs
        self._convert_options: dict[str, Any] = {
            "module_filter_fn": module_filter_fn,
            "layernorm_linear": list(layernorm_linear),
            "layernorm_linear_sequential": layernorm_linear_sequential,
            "on_unsupported": on_unsupported,
        }

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module`` in place (see the class); converting twice changes nothing."""
        if self.convert:
            module = convert_model(module, **self._convert_options)
        if self.fp8_min_gemm_macs is not None:
            for child in module.modules():
                if isinstance(child, FP8StateMixin):
                    child.fp8_min_gemm_macs = self.fp8_min_gemm_macs
        return module

    def forward_context(self) -> fp8_autocast:
        """A new ``fp8_autocast`` with the recipe, for one forward (or step)."""
        return fp8_autocast(fp8_recipe=self.recipe, gemm_backend=self.gemm_backend)


class TrainerFP8Precision(TrainerPrecision, FabricFP8Precision):
    """FP8 training for ``Trainer``: the model is converted at setup, every step runs in FP8.

    Everything :class:`FabricFP8Precision` does, for ``Trainer(plugins=...)``: training,
    validation, test and predict steps run under ``fp8_autocast(fp8_recipe=recipe)``. (Give
    ``Fabric`` the Fabric plugin: this one runs backward through the ``LightningModule``.)

    Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) hold the weights in
    ``checkpoint["state_dict"]`` under the unconverted model's names, as
    :func:`fp8state.checkpoint.to_plain_state_dict` spells them, and the FP8 metadata under
    ``checkpoint["fp8state"]``: Lightning restores a checkpoint into the model *before* the
    plugin converts it, so the state dict must fit the model as you built it. Hence:

    - ``trainer.fit(model, ckpt_path=...)`` (also ``validate``/``test``/``predict``) with a
      fresh, unconverted model restores the weights, then the plugin converts the model
      and restores every FP8 module's metadata exactly: a resumed run continues bit for bit.
    - A model this plugin already converted (``trainer.test(model, ckpt_path="best")`` after
      ``fit``) is restored too, metadata included.
    - ``MyModule.load_from_checkpoint(path)`` gives the unconverted model with the trained
      weights (its FP8 metadata is not used).
    - A checkpoint written with ``save_weights_only=True`` skips plugin hooks in Lightning:
      it holds the converted model's state dict, ``_extra_state`` keys included; load it
      with :func:`fp8state.checkpoint.load_state_dict` into a converted model.

    Args:
        recipe: The delayed-scaling recipe (default ``fp8state.DelayedScaling()``).
        convert: Convert the model at setup. With False the model must be built with
            fp8state modules, and checkpoints keep Lightning's usual layout.
        module_filter_fn: As in :func:`fp8state.convert_model`.
        layernorm_linear: As in :func:`fp8state.convert_model`.
        layernorm_linear_sequential: As in :func:`fp8state.convert_model`.
        on_unsupported: As in :func:`fp8state.convert_model`.
        fp8_min_gemm_macs: When given, set on every FP8 module after conversion.
        gemm_backend: As in :class:`fp8state.fp8_autocast`.

    Raises:
        ConfigError: an argument of the wrong kind.
    """

    #: The LightningModule the plugin converted last (checkpoints are written from it).
    _model: nn.Module | None = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module`` in place; remember it for checkpoints and later restores."""
        native = _fp8_module_names(module)  # before conversion: the modules it was built with
        module = super().convert_module(module)
        if self.convert:
            self._model = module
            if not isinstance(module.__dict__.get("on_load_checkpoint"), _Converted):
                # Lightning loads checkpoint["state_dict"] right after this hook: a model that
                # is converted already needs the metadata put back into it first.
                module.__dict__["on_load_checkpoint"] = _Converted(module, native)
        return module

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Write the weights as the model was built, the converted modules' metadata beside."""
        model = self._model
        record = None if model is None else model.__dict__.get("on_load_checkpoint")
        if model is None or not isinstance(record, _Converted):
            return
        weights, metadata = to_plain_state_dict(model, fp8_metadata="separate")
        if not metadata:
            return  # no FP8 module: Lightning's state dict is the plain one already
        built_with = checkpoint["state_dict"]
        for name in record.native:  # fp8state modules the model was built with keep theirs
            key = f"{name}.{EXTRA_STATE_KEY}" if name else EXTRA_STATE_KEY
            weights[key] = built_with[key]
        checkpoint["state_dict"] = weights
        checkpoint[CHECKPOINT_KEY] = {"fp8_metadata": metadata}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """After conversion: the checkpoint's weights and FP8 metadata into the model."""
        if self._model is not None:
            restore_fp8_checkpoint(self._model, checkpoint)


def _fp8_module_names(module: nn.Module) -> frozenset[str]:
    return frozenset(n for n, m in module.named_modules() if isinstance(m, FP8StateMixin))


def restore_fp8_checkpoint(model: nn.Module, checkpoint: dict[str, Any]) -> bool:
    """Load a checkpoint :class:`TrainerFP8Precision` wrote into the converted ``model``.

    ``checkpoint["state_dict"]`` holds the weights under the unconverted model's names (and
    the ``_extra_state`` of the fp8state modules it was built with), ``checkpoint["fp8state"]``
    every FP8 module's metadata. Both go in through
    :func:`fp8state.checkpoint.load_plain_state_dict` (strict: every problem is listed and
    nothing changes). ``checkpoint["state_dict"]`` then becomes ``model``'s own state dict,
    so that a ``load_state_dict`` of it that follows (Lightning's) fits, and the metadata
    entry is removed, so that the work is done once.

    Args:
        model: The converted model (the LightningModule).
        checkpoint: The loaded checkpoint; changed as said above.

    Returns:
        True when the checkpoint held FP8 metadata to restore; False (nothing done) for a
        checkpoint written without the plugin, or restored already.

    Raises:
        CheckpointError: the metadata entry is not what the plugin writes.
        StateDictError: the weights or metadata do not fit ``model``.
    """
    section = checkpoint.get(CHECKPOINT_KEY)
    if section is None:
        return False
    metadata = section.get("fp8_metadata") if isinstance(section, dict) else None
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f'checkpoint["{CHECKPOINT_KEY}"]',
            f"a {type(section).__name__}" if metadata is None else f"a {type(metadata).__name__}",
            'a dict {"fp8_metadata": {...}}, as TrainerFP8Precision writes it',
            "Restore a checkpoint that TrainerFP8Precision wrote, or delete the entry to "
            "start every converted module's FP8 metadata fresh.",
        )
    # The metadata map covers every FP8 module; drop the copy the state dict keeps of some.
    owners = set()
    for flat in metadata:
        head, mark, _ = flat.partition(EXTRA_STATE_KEY + ".")
        if mark:
            owners.add(head + EXTRA_STATE_KEY)
    weights = {k: v for k, v in checkpoint["state_dict"].items() if k not in owners}
    load_plain_state_dict(model, weights, fp8_metadata=metadata)
    checkpoint["state_dict"] = model.state_dict()
    del checkpoint[CHECKPOINT_KEY]
    return True


class _Converted:
    """What TrainerFP8Precision records on a LightningModule it converted.

    Set as the instance's ``on_load_checkpoint``: the module's own hook runs, then the
    restore. ``native`` names the fp8state modules the model was built with, whose metadata
    the unconverted model's state dict holds.
    """

    def __init__(self, module: nn.Module, native: frozenset[str]) -> None:
        self.module = module
        self.native = native

    def __call__(self, checkpoint: dict[str, Any]) -> None:
        type(self.module).on_load_checkpoint(self.module, checkpoint)  # type: ignore[attr-defined]
        restore_fp8_checkpoint(self.module, checkpoint)
