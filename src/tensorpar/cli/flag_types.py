"""argparse types of the commands' numeric flags: the bound is checked and named in the error.

Example::

    parser.add_argument("--steps", type=positive(int))    # "--steps 0": must be an integer > 0, got 0
"""

from __future__ import annotations

import argparse
import math


def number(kind, *, low: float, low_inclusive: bool = True, high: float | None = None, high_inclusive: bool = False):
    """An argparse type: a finite ``kind`` in ``[low, high)`` (``(low, ...`` unless ``low_inclusive``,
    ``..., high]`` with ``high_inclusive``)."""
    bound = (f"{'>=' if low_inclusive else '>'} {low:g}" if high is None
             else f"in {'[' if low_inclusive else '('}{low:g}, {high:{'d' if kind is int else 'g'}}"
                  f"{']' if high_inclusive else ')'}")
    what = "an integer" if kind is int else "a finite number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} "
                                             f"{bound}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not low_inclusive) \
                or (high is not None and (value > high or (value == high and not high_inclusive))):
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text}")
        return value
    return parse


def positive(kind, *, most: float | None = None):
    return number(kind, low=0, low_inclusive=False, high=most, high_inclusive=True)


def non_negative(kind, *, most: float | None = None):
    return number(kind, low=0, high=most, high_inclusive=True)


# What a count of steps or of sequences can be: past these, a run fails after launch (a C int, a
# tensor's size) or runs forever.
MOST_STEPS = 10**12
MOST_SEQUENCES = 2**31


def overlap(text: str):
    """``--overlap``: off, auto or a number of chunks."""
    if text in ("off", "auto"):
        return text
    try:
        return positive(int)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected off, auto or a positive number of chunks, got {text!r}") from None


# A collective needs a second to connect; a week is longer than any step waits for a peer.
TIMEOUT = number(float, low=1, high=7 * 24 * 3600)
# torch seeds are 64-bit; the streams add small offsets (TP rank, resumed step) to the seed.
SEED = number(int, low=0, high=2**32)
