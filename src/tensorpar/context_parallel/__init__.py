"""Context parallelism (CP): the sequence of every sample split over a group of ranks.

Each CP rank holds two chunks of every sequence (:class:`SequenceChunks`: chunks ``i`` and
``2CP-1-i`` of ``2CP``, for causal load balance; any length, padded at the end) and the same
weights. Attention is the only layer that needs other ranks' tokens; two exact ways:

* :func:`ulysses_attention` (``a2a``): all-to-all to a head split, whole-sequence attention per
  rank, all-to-all back. Any heads and K/V heads with at least one query head per rank.
* :func:`ring_attention` (``p2p``): K/V passed around the ring, overlapped with the attention
  of the block in hand, partial results merged by log-sum-exp.

Example::

    chunks = SequenceChunks.of(seq_len, cp_group=group)
    q, k, v = (chunks.shard(t, dim=2) for t in (q_full, k_full, v_full))
    out = context_attention(q, k, v, comm_type="p2p", cp_group=group)
    full = chunks.gather(out, dim=2, cp_group=group)
"""

from __future__ import annotations

from .chunks import SequenceChunks, chunk_ids, natural_order
from .ring import ring_attention
from .ulysses import head_split, ulysses_attention

COMM_TYPES = ("a2a", "p2p")


def context_attention(q, k, v, *, comm_type: str, cp_group, scale: float | None = None, kv_of_head=None):
    """Causal attention of this CP rank's tokens by ``comm_type`` (``"a2a"`` or ``"p2p"``);
    ``kv_of_head``: the K/V head each query head reads (default: GQA's even runs)."""
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, cp_group=cp_group, scale=scale, kv_of_head=kv_of_head)
    if comm_type == "p2p":
        return ring_attention(q, k, v, cp_group=cp_group, scale=scale, kv_of_head=kv_of_head)
    raise ValueError(f"context-parallel comm_type must be one of {COMM_TYPES}, got {comm_type!r}")


__all__ = ["COMM_TYPES", "SequenceChunks", "chunk_ids", "context_attention", "head_split", "natural_order",
           "ring_attention", "ulysses_attention"]
