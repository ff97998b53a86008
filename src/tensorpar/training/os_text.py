"""Text that names files: a path that is not UTF-8 reaches Python as text holding surrogate
escapes of its bytes (PEP 383). It names the file as it is; these say so and show it.

Example::

    name = os.fsdecode(b"caf\\xe9.txt")
    is_unicode(name), os_bytes(name), shown(name)    # False, b"caf\\xe9.txt", "caf\\\\xe9.txt"
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def is_unicode(text: str) -> bool:
    """Whether ``text`` is UTF-8 text (no surrogate escapes of bytes that are not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def os_bytes(text: str) -> bytes:
    """The bytes ``text`` stands for: surrogate escapes back to the OS's bytes (any other lone
    surrogate, which no OS gives, e.g. from a hand-made JSON file, as its ``\\uNNNN`` escape)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace")


def shown(text: str) -> str:
    """``text`` for a person: bytes that are not UTF-8 as ``\\xNN``."""
    return os_bytes(text).decode("utf-8", "backslashreplace")


@contextlib.contextmanager
def utf8_named(path):
    """``path``; or, where its name is not UTF-8 (which a library that takes only UTF-8 names, as
    Hugging Face ``tokenizers`` does, cannot open), a link to it with a UTF-8 name while the block runs."""
    if is_unicode(str(path)):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="tensorpar-") as tmp:
        link = Path(tmp) / "link"
        os.symlink(os.path.abspath(path), link)
        yield link
