"""Attention dropout whose mask is a function of where it is: (global head, query position, key
position), so a context-parallel rank draws, for the part of attention it computes, the mask
CP=1 draws there.

SDPA draws its dropout mask inside the kernel, in an order no other split of the work can
replay. Here each attention call takes one draw of the default stream (every rank alike, as
the hidden dropout does) and each global head ``h`` gets the mask of a ``[seq_len queries,
b, seq_len keys]`` tensor drawn in blocks of whole query rows (:func:`tensorpar.tensor_parallel.random.dropout`'s
blocks, seeded by that draw and ``h``): a rank draws only the query rows it has and keeps the
keys it reads. Neither the TP nor the CP size enters, only the sequence's real length.
Padding rows and keys (past ``seq_len``) are dropped: causal attention never reads them.
Traced by ``torch.compile`` on CPU, the draw is the graph's and an opaque op draws the same
blocks from it: a rank still draws its own heads' masks only.

Example::

    base = draw_base()                                   # once per attention call, on every rank
    keep = keep_mask(base, 0.1, batch=2, heads=range(2, 4), rows=[(0, 16)], seq_len=13, keys=16)
    probs = apply(probs, keep=keep, p=0.1)               # probs [2, 2, 16, 16]
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from ..tensor_parallel.keep_masks import block_keep_mask, graph_seed


def draw_base() -> int | torch.Tensor:
    """One draw of the default CPU stream: the same on every rank whose streams agree. Traced,
    the graph's draw (:func:`tensorpar.tensor_parallel.keep_masks.graph_seed`), a 0-dim tensor."""
    return graph_seed() if torch.compiler.is_compiling() else int(torch.randint(0, 1 << 62, (1,)))


def _head_base(base: int, head: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr((base, "attention", head)).encode(), digest_size=8).digest(),
                          "little") >> 1


def keep_mask(base: int | torch.Tensor, p: float, *, batch: int, heads: Sequence[int], rows: list[tuple[int, int]],
              seq_len: int, keys: int, device=None) -> torch.Tensor:
    """``[batch, len(heads), sum of rows' counts, keys]`` booleans, True at probability ``1 - p``:
    global heads ``heads``, the query positions of ``rows`` (``(first position, count)`` runs,
    in order) and key positions ``0..keys-1`` of a sequence of ``seq_len`` real positions.
    ``base``: :func:`draw_base`'s; traced, a tensor, and an opaque op draws the same blocks from it."""
    if isinstance(base, torch.Tensor):
        flat_rows = [number for run in rows for number in run]
        return _keep_mask_op(base, p, batch, list(heads), flat_rows, seq_len, keys, torch.device(device or "cpu"))
    count = sum(n for _, n in rows)
    keep = torch.stack([block_keep_mask((count, batch, seq_len), 1.0 - p, device, rows, seq_len,
                                        base=_head_base(base, h)) for h in heads], dim=1)   # [rows, heads, b, seq_len]
    keep = keep.permute(2, 1, 0, 3)
    if keys > seq_len:  # padding keys: never read by a real query
        keep = torch.cat([keep, keep.new_zeros((*keep.shape[:-1], keys - seq_len))], dim=-1)
    return keep


@torch.library.custom_op("tensorpar::attention_keep_mask", mutates_args=())
def _keep_mask_op(seed: torch.Tensor, p: float, batch: int, heads: list[int], rows: list[int], seq_len: int,
                  keys: int, device: torch.device) -> torch.Tensor:
    """:func:`keep_mask` of the traced base ``seed`` (a CPU tensor: reading it waits for no device),
    in memory of its own (saved for backward)."""
    runs = list(zip(rows[::2], rows[1::2]))
    return keep_mask(int(seed), p, batch=batch, heads=heads, rows=runs, seq_len=seq_len, keys=keys,
                     device=device).contiguous()


_keep_mask_op.register_fake(lambda seed, p, batch, heads, rows, seq_len, keys, device: torch.empty(
    (batch, len(heads), sum(rows[1::2]), keys), dtype=torch.bool, device=device))


def apply(probs: torch.Tensor, *, keep: torch.Tensor, p: float) -> torch.Tensor:
    """``probs`` dropped by ``keep`` and scaled by ``1 / (1 - p)``."""
    return probs * keep / (1.0 - p)
