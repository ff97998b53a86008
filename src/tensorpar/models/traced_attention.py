"""Attention whose probabilities are dropped per TP rank's heads, for ``torch.compile``.

SDPA draws its dropout mask from the default generator, which is the same on every TP rank;
eager tensorpar swaps in the per-rank stream around it (``get_rng_tracker().fork()``), which
a traced graph cannot do. Traced, attention is written out instead, and its probabilities go
through :func:`tensorpar.random.sharded_dropout`: each rank keeps its heads' slice of one mask.
The TP-invariant mode writes it out too, dropping with its per-head keyed masks
(:func:`tensorpar.invariant_dropout.drop_heads`).
"""

from __future__ import annotations

import torch

from ..random import sharded_dropout


def attention_with_sharded_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                   mask: torch.Tensor | None, dropout_p: float, gqa: bool,
                                   first_head: int, num_heads: int) -> torch.Tensor:
    """SDPA's result for ``q [b, heads/TP, s, d]`` (this rank's heads from ``first_head`` of
    ``num_heads``), ``k``/``v`` (fewer heads if ``gqa``), with dropout on the probabilities.

    ``mask``: boolean (True attends) or additive, broadcast to the scores; None: causal.

    Example::

        out = attention_with_sharded_dropout(q, k, v, mask=None, dropout_p=0.1, gqa=False,
                                             first_head=rank * 4, num_heads=8)
    """
    return written_out_attention(q, k, v, mask=mask, gqa=gqa, drop=lambda probs: sharded_dropout(
        probs, dropout_p, dim=1, start=first_head, full_size=num_heads))


def written_out_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None,
                          gqa: bool, drop) -> torch.Tensor:
    """``drop(softmax(q k^T / sqrt(d) + mask)) v``: SDPA's result with ``drop`` applied to the
    probabilities ``[b, heads/TP, s, keys]``; ``mask`` as :func:`attention_with_sharded_dropout`'s."""
    if gqa:  # query head i reads K/V head i // (heads / K/V heads), as SDPA's enable_gqa
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return drop(probs) @ v
