r"""What the console script writes to a terminal: one escaping point for text from files.

Keys, module names and paths come from checkpoints, which anyone may have written. Printed
raw, an ESC or OSC sequence in a key retitles or recolours the user's terminal, and a
newline or carriage return forges a line of output ("wrote model.pt"). Every line the CLI
writes goes through :func:`say`: control characters (C0 and C1, DEL), the Unicode line and
paragraph separators and the bidirectional formatting characters are written as escapes
(``\x1b``, ``\n``, ``\u202e``), so each line written is exactly one line, in its own order.
JSON output needs none of this: ``json.dumps`` escapes them itself.
"""

from __future__ import annotations

import sys
import unicodedata
from typing import TextIO

__all__ = ["escape_controls", "say"]

# Characters that are not controls by category but reorder or break lines on a terminal.
_ALSO = {"\u2028", "\u2029"} | {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    r"""``text`` with every control, line-breaking or reordering character escaped.

    Backslashes are doubled, so an escape in the output always stands for a character that
    was there: a key spelled ``a\x1bb`` and one holding a real ESC print differently.

    Example:
        >>> escape_controls("blocks.0\x1b]0;owned\x07\nwrote model.pt")
        'blocks.0\\x1b]0;owned\\x07\\nwrote model.pt'
    """
    if text.isprintable() and "\\" not in text:  # the common case: nothing to do
        return text
    return "".join(
        _escape(c)
        if c in _SHORT or c in _ALSO or unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")
        else c
        for c in text
    )


def say(*lines: str, file: TextIO | None = None) -> None:
    """Write each of ``lines`` as one line, escaped (stdout unless ``file``)."""
    out = sys.stdout if file is None else file
    for line in lines:
        print(escape_controls(line), file=out)
