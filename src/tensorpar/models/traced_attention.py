"""Attention written out, its probabilities dropped by a mask SDPA could not draw.

SDPA draws its dropout mask inside the kernel, in an order no other split of the work (TP
ranks' heads, CP ranks' blocks) can replay. So attention with dropout is written out: eager,
with each global head's mask by position (:mod:`tensorpar.context_parallel.attention_dropout`, the mask
a CP rank draws again for its part); traced by ``torch.compile``, which cannot seed
generators, with this rank's heads' slice of one mask (:func:`tensorpar.tensor_parallel.random.sharded_dropout`);
in the TP-invariant mode with its per-head keyed masks (:func:`tensorpar.invariant.dropout.drop_heads`).
"""

from __future__ import annotations

import torch



def written_out_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None,
                          causal: bool, gqa: bool, drop) -> torch.Tensor:
    """SDPA's result for ``q [b, heads/TP, s, d]`` over ``k``/``v`` (fewer heads if ``gqa``),
    with ``drop`` applied to the probabilities ``[b, heads/TP, s, keys]``: ``drop(softmax(q k^T
    / sqrt(d) + mask)) v``. ``mask``: boolean (True attends) or additive, broadcast to the
    scores; without one, ``causal`` as SDPA's ``is_causal`` (top-left aligned).

    Example::

        out = written_out_attention(q, k, v, mask=None, causal=True, gqa=False,
                                    drop=lambda probs: sharded_dropout(probs, 0.1, dim=1, start=0, full_size=8))
    """
    if gqa:  # query head i reads K/V head i // (heads / K/V heads), as SDPA's enable_gqa
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if mask is None and causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return drop(probs) @ v
