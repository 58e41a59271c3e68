"""The package's layers: no import cycle, no upward import, no reach into another's privates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _helpers.import_graph import LAYERS, Violation, import_graph, modules_of, violations
from _helpers.paths import DOCS, REPO_ROOT

PACKAGE = REPO_ROOT / "fp8state"


def test_fp8state_breaks_no_layer_rule() -> None:
    assert violations(PACKAGE) == []


def test_every_import_is_counted() -> None:
    graph = import_graph(PACKAGE)
    # A function-level import (the TE decoder, loaded only for TE values) is an edge too.
    assert "fp8state._te.extra_state" in graph["fp8state._runtime.meta_io"]
    # `from package import module` is an edge to the module, not to the package.
    assert "fp8state._runtime.staging" in graph["fp8state.mixin"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


_TOY_LAYERS = (("low", ("low", "_private")), ("high", ("high", "sub")), ("package", ("__init__",)))


def _kinds(found: list[Violation]) -> list[str]:
    return sorted({v.kind for v in found})


def test_a_clean_toy_package_passes(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import high\n",
            "pkg/low.py": "",
            "pkg/_private.py": "import pkg.low\n",
            "pkg/high.py": "from pkg import low, _private\n",
            "pkg/sub/__init__.py": "from pkg.sub._impl import f\n",
            "pkg/sub/_impl.py": "def f():\n    from pkg import high\n",
        },
    )
    assert violations(pkg, _TOY_LAYERS) == []


@pytest.mark.parametrize(
    ("files", "kind"),
    [
        # Two modules importing each other, one of them inside a function.
        (
            {
                "pkg/low.py": "import pkg._private\n",
                "pkg/_private.py": "def f():\n    from pkg import low\n",
            },
            "cycle",
        ),
        # Under TYPE_CHECKING still counts.
        (
            {
                "pkg/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from pkg.high import X\n",
                "pkg/high.py": "X = 1\n",
            },
            "upward",
        ),
        ({"pkg/low.py": "def f():\n    import pkg.high\n", "pkg/high.py": ""}, "upward"),
        (
            {
                "pkg/high.py": "from pkg.sub import _impl\n",
                "pkg/sub/__init__.py": "",
                "pkg/sub/_impl.py": "",
            },
            "private",
        ),
        (
            {
                "pkg/high.py": "import pkg.sub.x\n",
                "pkg/sub/__init__.py": "",
                "pkg/sub/x.py": "import pkg.high\n",
            },
            "package cycle",
        ),
        ({"pkg/stray.py": ""}, "unassigned"),
    ],
    ids=[
        "cycle",
        "type-checking-upward",
        "function-upward",
        "private",
        "package-cycle",
        "unassigned",
    ],
)
def test_each_kind_of_violation_is_caught(tmp_path: Path, files: dict[str, str], kind: str) -> None:
    pkg = _write(tmp_path, {"pkg/__init__.py": "", **files})
    assert kind in _kinds(violations(pkg, _TOY_LAYERS))


def test_architecture_page_lists_the_layers_and_packages() -> None:
    """docs/architecture.md's layer table names exactly the code's layers and their units."""
    text = (DOCS / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\w-]+) \| ([^|]+) \|", text, re.M)
    documented = [
        (layer, tuple(u.strip(" `/") for u in units.split(","))) for _, layer, units in rows
    ]
    assert documented == [(name, units) for name, units in LAYERS]
    on_disk = {name.split(".")[1] for name in modules_of(PACKAGE) if "." in name}
    assert on_disk | {"__init__"} == {u for _, units in LAYERS for u in units}


def test_names_say_one_thing() -> None:
    """The function is fp8state.recalibrate, its package fp8state.recalibration; likewise
    convert; every sub-command lives in cli/<name>_cmd.py."""
    import importlib
    import inspect

    import fp8state
    import fp8state.cli

    assert inspect.isfunction(fp8state.recalibrate)
    assert importlib.import_module("fp8state.recalibration").recalibrate is fp8state.recalibrate
    assert importlib.import_module("fp8state.convert").convert_model is fp8state.convert_model
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fp8state.recalibrate")
    commands = fp8state.cli._COMMANDS
    assert commands == {name: f"fp8state.cli.{name}_cmd" for name in commands}
    files = {p.stem for p in (PACKAGE / "cli").glob("*_cmd.py")}
    assert files == {f"{name}_cmd" for name in commands}
