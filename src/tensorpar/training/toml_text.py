"""One value as TOML text: what the run-config block and ``config.toml`` are written with.

Text that is not UTF-8 (a path the OS gave as other bytes, which Python holds as surrogate
escapes) cannot be a TOML string: it is written as the array of its bytes, which
``--config`` reads back as that text.

Example: ``toml_value(3e-4)`` is ``"0.0003"``, ``toml_value("a\\"b")`` is ``'"a\\u0022b"'``,
``toml_value(os.fsdecode(b"caf\\xe9"))`` is ``"[99, 97, 102, 233]"``.
"""

from __future__ import annotations

import math

from .os_text import is_unicode, os_bytes, shown


def toml_value(value) -> str:
    """``value`` (bool, int, float, str or a dict of them) as a TOML value; a dict's None entries are left out."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items() if v is not None) + " }"
    text = str(value)
    if not is_unicode(text):
        return "[" + ", ".join(map(str, os_bytes(text))) + "]"
    # A TOML basic string: quote, backslash and control characters escaped.
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F or c in '"\\' else c
                         for c in text) + '"'


def toml_setting(key: str, value) -> str:
    """The line ``key = value``; text that is not UTF-8 gets a comment line above showing it."""
    line = f"{key} = {toml_value(value)}"
    if isinstance(value, str) and not is_unicode(value):
        return f"# {key} is not UTF-8, so it is written as its bytes: {shown(value)}\n{line}"
    return line

