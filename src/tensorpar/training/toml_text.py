"""One value as TOML text: what the run-config block and ``config.toml`` are written with.

Example: ``toml_value(3e-4)`` is ``"0.0003"``, ``toml_value("a\\"b")`` is ``'"a\\u0022b"'``.
"""

from __future__ import annotations

import math


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
    # A TOML basic string: quote, backslash and control characters escaped.
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F or c in '"\\' else c
                         for c in str(value)) + '"'
