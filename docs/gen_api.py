"""Render docs/api.md, the API reference, from the public names' signatures and docstrings.

Run from the repository root:

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is not what this would write

Standard library only (``inspect``, ``ast``): the reference is the code's own docstrings,
grouped by the module users import them from. ``tests/docs/test_docs_api.py`` runs ``--check`` and
the doctests of every object listed here.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "api.md"

#: (module users import from, what the section is for). Names come from each module's
#: ``__all__``; sub-modules listed in ``fp8state.__all__`` get their own section.
SECTIONS: tuple[tuple[str, str], ...] = (
    ("fp8state", "Modules, recipe, autocast, model conversion and recalibration."),
    ("fp8state.checkpoint", "Loading, validating, DCP, consolidation, plain checkpoints."),
    ("fp8state.migrate", "TransformerEngine checkpoints of every era."),
    ("fp8state.errors", "Every error fp8state raises on purpose."),
    ("fp8state.functional", "Building blocks for your own FP8 modules."),
    ("fp8state.slots", "Slot numbering (TransformerEngine's)."),
    ("fp8state.scaling", "The delayed-scaling math, as pure functions."),
    ("fp8state.schema", "The extra-state payload: pack, validate, unpack."),
    ("fp8state.backends", "Which GEMM backend runs, and the small-GEMM threshold."),
)

#: Methods that only override ``torch.nn.Module`` plumbing; nothing to say to a user.
SKIP_MEMBERS = frozenset({"extra_repr"})
#: Values not printed (they change with every release).
HIDE_VALUE = frozenset({"__version__"})

_SECTION_HEADER = re.compile(
    r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples|Note|Notes):\s*$"
)
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public name of the reference."""

    module: str  # the module users import it from
    name: str
    obj: Any

    @property
    def qualname(self) -> str:
        """The name as users spell it, e.g. ``fp8state.checkpoint.load``."""
        return f"{self.module}.{self.name}"


def public_names(module: ModuleType) -> list[str]:
    """The module's ``__all__``, without sub-modules (they have sections of their own)."""
    return [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]


def entries() -> Iterator[Entry]:
    """Every public name of the reference, in section order."""
    for module_name, _ in SECTIONS:
        module = importlib.import_module(module_name)
        for name in public_names(module):
            yield Entry(module_name, name, getattr(module, name))


def doctest_objects() -> Iterator[tuple[str, Any]]:
    """``(name, object)`` pairs whose docstrings the reference shows: modules and entries."""
    for module_name, _ in SECTIONS:
        yield module_name, importlib.import_module(module_name)
    for entry in entries():
        if inspect.isclass(entry.obj) or inspect.isroutine(entry.obj):
            yield entry.qualname, entry.obj


# ---------------------------------------------------------------------------------- rendering
def _inline(text: str) -> str:
    """RST inline markup to Markdown: ``x`` and :role:`x` become `x`."""
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    return text.replace("``", "`")


def _fence(lines: list[str], lang: str = "") -> list[str]:
    return [f"```{lang}", *lines, "```"]


def _items(body: list[str]) -> list[str]:
    """Google-style ``name: text`` items (with indented continuation lines) as a list."""
    out: list[str] = []
    for line in textwrap.dedent("\n".join(body)).splitlines():
        if not line.strip():
            continue
        if line[0] != " ":
            name, sep, text = line.partition(":")
            out.append(f"- `{name.strip()}`{sep}{_inline(text)}" if sep else f"- {_inline(line)}")
        else:
            out[-1] += " " + _inline(line.strip())
    return out


def _example(body: list[str]) -> list[str]:
    """An Example section: prose as paragraphs, doctest sessions as ``pycon`` blocks."""
    out: list[str] = []
    session: list[str] = []
    lines = textwrap.dedent("\n".join(body)).splitlines()
    for line in lines:
        if line.startswith(">>>") or (session and line.strip()):
            session.append(line)
            continue
        if session:
            out += [*_fence(session, "pycon"), ""]
            session = []
        if line.strip():
            out.append(_inline(line.strip()))
        elif out and out[-1] != "":
            out.append("")
    if session:
        out += _fence(session, "pycon")
    return out


def _free_text(lines: list[str]) -> list[str]:
    """Prose outside sections: RST tables and doctest sessions fenced, indents kept < 4."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("==="):  # an RST simple table: three rule lines
            table = [line]
            i += 1
            rules = 1
            while i < len(lines) and rules < 3:
                table.append(lines[i])
                rules += lines[i].startswith("===")
                i += 1
            out += _fence(table)
            continue
        if line.lstrip().startswith(">>>"):
            session = []
            while i < len(lines) and lines[i].strip():
                session.append(
                    lines[i].strip() if lines[i].lstrip().startswith((">>>", "...")) else lines[i]
                )
                i += 1
            out += _fence(textwrap.dedent("\n".join(session)).splitlines(), "pycon")
            continue
        stripped = line.lstrip()
        indent = min(len(line) - len(stripped), 3)  # 4 spaces would start a code block
        out.append(" " * indent + _inline(stripped) if stripped else "")
        i += 1
    return out


def render_docstring(doc: str | None) -> list[str]:
    """A Google-style docstring as Markdown lines."""
    if not doc:
        return []
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    prose: list[str] = []
    i = 0
    while i < len(lines):
        match = _SECTION_HEADER.match(lines[i])
        if not match:
            prose.append(lines[i])
            i += 1
            continue
        out += _free_text(prose)
        prose = []
        header = match.group(1)
        body: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        if out and out[-1] != "":
            out.append("")
        out += [f"**{header}:**", ""]
        if header in ("Args", "Arguments", "Attributes", "Raises"):
            out += _items(body)
        elif header in ("Example", "Examples"):
            out += _example(body)
        else:
            out += [_inline(line.strip()) if line.strip() else "" for line in body]
        out.append("")
    out += _free_text(prose)
    while out and not out[-1]:
        out.pop()
    return out


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, str):  # ``from __future__ import annotations``: already source
        return annotation
    return inspect.formatannotation(annotation)


def _default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def _param(param: inspect.Parameter) -> str:
    text = param.name
    if param.kind is inspect.Parameter.VAR_POSITIONAL:
        text = "*" + text
    elif param.kind is inspect.Parameter.VAR_KEYWORD:
        text = "**" + text
    if param.annotation is not inspect.Parameter.empty:
        text += f": {_annotation(param.annotation)}"
        if param.default is not inspect.Parameter.empty:
            text += f" = {_default(param.default)}"
    elif param.default is not inspect.Parameter.empty:
        text += f"={_default(param.default)}"
    return text


def _signature(obj: Any, name: str, drop_self: bool = False, returns: bool = True) -> str:
    """``name(params) -> ret`` on one line, or one parameter per line when it is long."""
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())[1 if drop_self else 0 :]
    parts: list[str] = []
    for k, param in enumerate(params):
        before = params[k - 1].kind if k else None
        if param.kind is inspect.Parameter.KEYWORD_ONLY and before not in (
            inspect.Parameter.KEYWORD_ONLY,
            inspect.Parameter.VAR_POSITIONAL,
        ):
            parts.append("*")
        parts.append(_param(param))
        after = params[k + 1].kind if k + 1 < len(params) else None
        if param.kind is inspect.Parameter.POSITIONAL_ONLY and (
            after is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
    ret = ""
    if returns and sig.return_annotation is not inspect.Signature.empty:
        ret = f" -> {_annotation(sig.return_annotation)}"
    text = f"{name}({', '.join(parts)}){ret}"
    if len(text) <= 96:
        return text
    return "\n".join([f"{name}(", *(f"    {part}," for part in parts), f"){ret}"])


def _comments(obj: Any) -> dict[str, str]:
    """``#:`` comments above assignments in ``obj``'s source (a module or a class)."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return {}
    lines = textwrap.dedent(source).splitlines()
    tree = ast.parse("\n".join(lines))
    body = tree.body[0].body if inspect.isclass(obj) else tree.body  # type: ignore[attr-defined]
    found = {}
    for node in body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        comment: list[str] = []
        k = node.lineno - 2
        while k >= 0 and lines[k].strip().startswith("#:"):
            comment.insert(0, lines[k].strip()[2:].strip())
            k -= 1
        for target in targets:
            if comment:
                found[target] = " ".join(comment)
    return found


def _value(short: str, name: str, value: Any) -> str:
    if short in HIDE_VALUE:
        return f"{name}: {type(value).__name__}"
    simple = (int, float, str, tuple, frozenset)
    if isinstance(value, simple) or (
        isinstance(value, dict) and all(isinstance(v, simple) for v in value.values())
    ):
        text = repr(value)
        if len(text) <= 96:
            return f"{name} = {text}"
    return f"{name}: {type(value).__name__}"


def _source_path(obj: Any) -> str | None:
    try:
        path = Path(inspect.getfile(obj)).resolve()
    except TypeError:
        return None
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return None


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", title.lower())
    return text.replace(" ", "-")


def _public_name(cls: type) -> str:
    """How users spell a base class (``torch.nn.Module``, ``ValueError``, ``FP8StateMixin``)."""
    if cls.__module__ == "builtins" or cls.__module__.startswith("fp8state"):
        return cls.__qualname__
    for alias in ("torch.nn", "torch"):
        if getattr(importlib.import_module(alias), cls.__qualname__, None) is cls:
            return f"{alias}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_private_base(cls: type) -> bool:
    return cls.__module__.startswith("fp8state") and cls.__name__.startswith("_")


def _bases(cls: type) -> str:
    """The public bases; a private fp8state base is replaced by its own bases."""
    names: list[str] = []
    pending = list(cls.__bases__)
    while pending:
        base = pending.pop(0)
        if base is object:
            continue
        if _is_private_base(base):
            pending[:0] = list(base.__bases__)
            continue
        name = f"`{_public_name(base)}`"
        if name not in names:
            names.append(name)
    return ", ".join(names)


def _owns_init(cls: type) -> bool:
    """True when fp8state (not torch or the standard library) defines ``cls``'s constructor."""
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__:
            return klass.__module__.startswith("fp8state")
    return False


def _members(cls: type) -> Iterator[tuple[str, Any, str]]:
    """Public methods and properties of ``cls`` and its private fp8state bases.

    Yields ``(name, object, kind)``; what public bases (``torch.nn.Module``) define is theirs.
    """
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is not cls and not _is_private_base(klass):
            continue
        for name, raw in klass.__dict__.items():
            if name.startswith("_") or name in SKIP_MEMBERS or name in seen:
                continue
            seen.add(name)
            if isinstance(raw, property):
                yield name, raw, "property"
            elif isinstance(raw, classmethod):
                yield name, getattr(cls, name), "classmethod"
            elif isinstance(raw, staticmethod):
                yield name, getattr(cls, name), "staticmethod"
            elif inspect.isfunction(raw):
                yield name, raw, "method"


def render_class(entry: Entry) -> list[str]:
    """A class: signature (or enum members), bases, docstring, attributes and members."""
    cls = entry.obj
    out: list[str] = []
    if issubclass(cls, enum.Enum):
        members = ", ".join(f"`{m.name}`" for m in cls)
        out += [f"Enum members: {members}.", ""]
    elif _owns_init(cls):
        out += [*_fence([_signature(cls, entry.qualname, returns=False)]), ""]
    bases = _bases(cls)
    source = _source_path(cls)
    facts = [f"Bases: {bases}." if bases else "", f"Source: `{source}`." if source else ""]
    if any(facts):
        out += [" ".join(f for f in facts if f), ""]
    out += render_docstring(cls.__doc__)
    comments = _comments(cls)
    attributes = [(n, c) for n, c in comments.items() if not n.startswith("_")]
    if attributes:
        out += ["", "**Class attributes:**", ""]
        out += [f"- `{n}`: {_inline(c)}" for n, c in attributes]
    for name, member, kind in _members(cls):
        title = f"{entry.name}.{name}"
        out += ["", f"#### `{title}`", ""]
        if kind == "property":
            out += [f"Property{' (settable)' if member.fset else ''}.", ""]
            doc = member.__doc__
        else:
            sig = _signature(member, name, drop_self=kind == "method")
            prefix = f"@{kind}\n" if kind != "method" else ""
            out += [*_fence([prefix + sig]), ""]
            doc = member.__doc__
        out += render_docstring(doc)
    return out


def render_entry(entry: Entry, constants: dict[str, str]) -> list[str]:
    """One name: heading, signature, source file, docstring."""
    obj = entry.obj
    out = [f"### `{entry.qualname}`", ""]
    if inspect.isclass(obj):
        out += render_class(entry)
    elif inspect.isroutine(obj):
        out += [*_fence([_signature(obj, entry.qualname)]), ""]
        source = _source_path(obj)
        if source:
            out += [f"Source: `{source}`.", ""]
        out += render_docstring(obj.__doc__)
    else:
        out += [*_fence([_value(entry.name, entry.qualname, obj)])]
        if entry.name in constants:
            out += ["", _inline(constants[entry.name])]
    return [*out, ""]


def render() -> str:
    """The whole of docs/api.md."""
    lines = [
        "# API reference",
        "",
        "<!-- Generated by `python docs/gen_api.py` from the docstrings; do not edit by hand. -->",
        "",
        "Every public name, grouped by the module you import it from, with its signature and "
        "docstring. The examples (`>>>`) run as doctests in the test suite "
        "(`tests/docs/test_docs_api.py`), on a CPU. Guides: [index](index.md).",
        "",
    ]
    by_module: dict[str, list[Entry]] = {}
    for entry in entries():
        by_module.setdefault(entry.module, []).append(entry)
    for module_name, purpose in SECTIONS:
        names = ", ".join(f"[`{e.name}`](#{_anchor(e.qualname)})" for e in by_module[module_name])
        lines.append(f"- [`{module_name}`](#{_anchor(module_name)}): {purpose} {names}")
    anchors = [_anchor(m) for m, _ in SECTIONS] + [
        _anchor(e.qualname) for es in by_module.values() for e in es
    ]
    duplicated = sorted({a for a in anchors if anchors.count(a) > 1})
    if duplicated:
        raise SystemExit(f"gen_api: headings share anchors: {duplicated}")
    for module_name, _ in SECTIONS:
        module = importlib.import_module(module_name)
        lines += ["", f"## `{module_name}`", ""]
        lines += render_docstring(module.__doc__)
        lines.append("")
        constants = _comments(module)
        for entry in by_module[module_name]:
            lines += render_entry(entry, constants)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/api.md, or with ``--check`` report whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if docs/api.md differs from what would be written",
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(
                f"{OUT.relative_to(REPO)} is out of date: run python docs/gen_api.py",
                file=sys.stderr,
            )
            return 1
        print(f"{OUT.relative_to(REPO)} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
