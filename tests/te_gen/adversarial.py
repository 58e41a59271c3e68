"""Malicious payloads in every place a TE checkpoint can carry pickled data.

Each payload, if it were unpickled by plain ``pickle``/``torch.load(weights_only=False)``, would
create a marker file or print a marker text. The tests check that fp8state refuses every one
and that neither marker appears.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from te_gen import recipes
from te_gen.tepickle import TEPickler, as_uint8, te_dumps, te_name

MARKER_TEXT = "FP8STATE-PWNED-MARKER"


class Call:
    """Pickles as ``func(*args)``: what an attacker puts into a pickle."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


@te_name("transformer_engine.common.recipe", "EvilRecipe")
class EvilRecipe:
    """A TE-named class fp8state does not know."""

    def __init__(self) -> None:
        self.margin = 0


@te_name("my_project.quantization", "make_quantizers")
def user_qfactory() -> None:
    """A user callable, as CustomRecipe(qfactory=...) pickles it by reference."""


def payloads(marker: str) -> dict[str, Any]:
    """Objects that run code when plain-unpickled; id -> (object, global it names)."""
    return {
        "os.system": (
            Call(os.system, f"touch {marker}"),
            f"{os.name == 'nt' and 'nt' or 'posix'}.system",
        ),
        "builtins.eval": (
            Call(builtins.eval, f"open({marker!r}, 'w').write('x')"),
            "builtins.eval",
        ),
        "subprocess": (Call(subprocess.check_call, ["touch", marker]), "subprocess.check_call"),
        "print": (Call(builtins.print, MARKER_TEXT), "builtins.print"),
        "unknown-te-class": (EvilRecipe(), "transformer_engine.common.recipe.EvilRecipe"),
        "custom-recipe-qfactory": (
            recipes.CustomRecipe(qfactory=user_qfactory, fp8_dpa=False),
            "my_project.quantization.make_quantizers",
        ),
    }


def in_uint8_pickle(obj: Any) -> torch.Tensor:
    """As the whole extra state of a uint8-pickle era (E04/E05, E08-E10)."""
    return as_uint8(te_dumps(obj))


def in_recipe_dict(obj: Any) -> torch.Tensor:
    """Hidden inside an otherwise valid E08-E10 dict."""
    state = {
        "recipe": recipes.delayed_scaling("E09", length=4),
        "scale_fwd": torch.ones(3),
        "amax_history_fwd": torch.zeros(4, 3),
        "scale_bwd": torch.ones(2),
        "amax_history_bwd": torch.zeros(4, 2),
        "extra_fp8_variables": {"num_gemms": 1, "payload": obj},
    }
    return as_uint8(te_dumps(state))


def in_bytesio_archive(obj: Any) -> io.BytesIO:
    """Inside the torch.save archive of an E06/E07 BytesIO."""
    buf = io.BytesIO()
    torch.save(
        {"scale_fwd": torch.ones(3), "extra_fp8_variables": obj}, buf, pickle_module=TEPickleModule
    )
    return buf


class _StorageBlob:
    """Pickles as ``torch.storage._load_from_bytes(blob)`` with a malicious legacy blob."""

    def __init__(self, obj: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf, _use_new_zipfile_serialization=False, pickle_module=TEPickleModule)
        self.blob = buf.getvalue()

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch.storage._load_from_bytes, (self.blob,))


def in_storage_blob(obj: Any) -> torch.Tensor:
    """As the nested legacy storage blob of a tensor inside a uint8 pickle."""
    return as_uint8(te_dumps({"scale_fwd": _StorageBlob(obj)}))


class TEPickleModule:
    """A ``pickle_module`` for torch.save that resolves te_gen's TE names."""

    Pickler = TEPickler
    __name__ = "te_gen_pickle"

    @staticmethod
    def dump(obj: Any, file: Any, protocol: int = 2) -> None:
        TEPickler(file, protocol=protocol).dump(obj)


PLACES: dict[str, Callable[[Any], Any]] = {
    "uint8-pickle": in_uint8_pickle,
    "inside-recipe-dict": in_recipe_dict,
    "bytesio-archive": in_bytesio_archive,
    "nested-storage-blob": in_storage_blob,
}


def plain_pickle(obj: Any) -> bytes:
    """The standard library's bytes for ``obj`` (for hand-made variants)."""
    return pickle.dumps(obj, protocol=2)
