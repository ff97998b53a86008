"""The errors the library raises: :class:`UsageError` for input that cannot work, and
:func:`check_index_range` for out-of-range token ids and labels, both naming the offending value.

How they reach the user (one line, exit codes, ``--debug``) is :mod:`tensorpar.cli.errors`.

Example::

    if tp > world:
        raise UsageError(f"--tp {tp} is larger than --nproc {world}")
"""

from __future__ import annotations

import os

DEBUG_ENV = "TENSORPAR_DEBUG"


class UsageError(ValueError):
    """Input that cannot work (a flag, a size, a path); the message names the offending values."""

    exit_code = 2


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _reads_back(tensor) -> bool:
    """Whether a range check may read its tensor back: free on CPU, a device sync elsewhere, and
    under ``torch.compile`` a graph break (the compiled check is ``torch._assert_async``)."""
    import torch

    if torch.compiler.is_compiling():
        return False
    return tensor.device.type == "cpu" or debug_enabled()


def check_index_range(index, size: int, what: str, where: str, *, ignore: int | None = None) -> None:
    """Raise ``ValueError("<what> <value> is <where>")`` if an entry of ``index`` is outside ``[0, size)``.

    ``ignore``: a value that is allowed too (an ``ignore_index``). On CPU, and anywhere with
    ``TENSORPAR_DEBUG=1``, the offending value is read back and named. On an accelerator (and
    under ``torch.compile``) the check is ``torch._assert_async``: the host never waits for the
    device (kernels keep being queued ahead), and a bad index stops the run when the device
    reaches the check.
    """
    import torch

    if index.numel() == 0:
        return
    if ignore is not None:
        index = index.masked_fill(index == ignore, 0)
    if _reads_back(index):
        low, high = (int(v) for v in index.aminmax())
        if low < 0 or high >= size:
            raise ValueError(f"{what} {low if low < 0 else high} is {where}")
    else:
        torch._assert_async(((index >= 0) & (index < size)).all(),
                            f"a {what} is {where} (TENSORPAR_DEBUG=1 names it)")
