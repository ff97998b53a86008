"""Text that reaches a terminal: control characters shown, never obeyed.

A prompt or a model's output may hold ESC and other control characters, which a terminal acts on
(moving the cursor, retitling the window, answering with bytes the shell then reads). On a
terminal they are printed escaped as ``repr`` shows them; a pipe or a file gets the text as is.

Example::

    print(for_terminal(text, stream=sys.stdout))     # "\\x1b[2J" on a terminal

A path that is not UTF-8 reaches Python as text holding surrogate escapes of its bytes;
:func:`keep_os_bytes` lets the standard streams print it as those bytes, as ``ls`` does.
"""

from __future__ import annotations

import contextlib


def _escape(char: str) -> str:
    return char if char.isprintable() or char in "\n\t" else repr(char)[1:-1]


def for_terminal(text: str, *, stream) -> str:
    """``text`` with every non-printable character but newline and tab escaped if ``stream`` is
    a terminal, else unchanged."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return text
    return "".join(map(_escape, text))


def keep_os_bytes(*streams) -> None:
    """Let UTF-8 ``streams`` write the surrogate escapes of bytes that are not UTF-8 (a path the OS
    gave) as those bytes, where stdout would raise ``UnicodeEncodeError`` and stderr write ``\\udcNN``."""
    for stream in streams:
        if (getattr(stream, "encoding", "") or "").lower().replace("-", "") == "utf8":
            # (not a text file, or one that cannot change now: it stays as it is)
            with contextlib.suppress(AttributeError, OSError, ValueError):
                stream.reconfigure(errors="surrogateescape")
