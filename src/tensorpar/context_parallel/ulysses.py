"""Ulysses attention (``a2a``): an all-to-all turns the sequence split into a head split, each
rank attends over the whole sequence with its heads, and a second all-to-all turns it back.

Any head counts at any CP size with at least one query head per rank: the query heads are split
as evenly as possible in contiguous runs (``balanced_sizes``), and each rank receives the K/V
heads its queries read, so a K/V head read by several ranks' queries is sent to each of them
(its gradient comes back from each and is summed by autograd). The heads may read their K/V
heads unevenly (``kv_of_head``: a TP rank's heads of an uneven TP split). Q, K and V travel in
one all-to-all of unequal splits, the output in another.

Collectives per call at CP > 1: forward 2 ``all_to_all`` (Q|K|V in, the output back),
backward 2 (their reverses).

Example::

    chunks = SequenceChunks.of(seq_len, cp_group=group)
    q, k, v = (chunks.shard(t, dim=2) for t in (q_full, k_full, v_full))   # [b, heads, 2L, d]
    out = ulysses_attention(q, k, v, cp_group=group)                      # this rank's queries
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..distributed import comm
from ..tensor_parallel.initialization import balanced_sizes
from ..tensor_parallel.mappings import all_to_all
from .chunks import natural_order


def head_split(num_heads: int, num_kv_heads: int, cp_size: int, *,
               kv_of_head: Sequence[int] | None = None) -> list[tuple[int, int, int, int]]:
    """Per CP rank, ``(first, stop)`` of its query heads and ``(first, stop)`` of the K/V heads
    they read: query head ``h`` reads K/V head ``kv_of_head[h]`` (non-decreasing; default
    ``h // (num_heads / num_kv_heads)``).

    Example::

        head_split(6, 2, 4)                           # [(0, 2, 0, 1), (2, 4, 0, 2), (4, 5, 1, 2), (5, 6, 1, 2)]
        head_split(3, 2, 2, kv_of_head=[0, 0, 1])     # [(0, 2, 0, 1), (2, 3, 1, 2)]
    """
    if num_heads < cp_size:
        raise ValueError(f"Ulysses (a2a) context parallelism needs at least one query head per CP rank: "
                         f"{num_heads} heads at CP {cp_size} (the p2p ring has no such limit)")
    reads = kv_reads(num_heads, num_kv_heads, kv_of_head)
    split, first = [], 0
    for size in balanced_sizes(num_heads, cp_size):
        split.append((first, first + size, reads[first], reads[first + size - 1] + 1))
        first += size
    return split


def kv_reads(num_heads: int, num_kv_heads: int, kv_of_head: Sequence[int] | None) -> list[int]:
    """The K/V head each query head reads: ``kv_of_head`` checked, or GQA's ``h // (heads / kv_heads)``."""
    if kv_of_head is None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_kv_heads} K/V heads do not divide {num_heads} query heads: pass kv_of_head")
        return [h // (num_heads // num_kv_heads) for h in range(num_heads)]
    reads = [int(g) for g in kv_of_head]
    if len(reads) != num_heads or sorted(set(reads)) != list(range(num_kv_heads)) or reads != sorted(reads):
        raise ValueError(f"kv_of_head {reads} must name, in non-decreasing order, one of the {num_kv_heads} K/V "
                         f"heads for each of the {num_heads} query heads, each K/V head read")
    return reads


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group,
                      scale: float | None = None, attention: Callable | None = None,
                      kv_of_head: Sequence[int] | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence, exact.

    ``q`` ``[b, heads, 2L, d]``, ``k`` and ``v`` ``[b, kv_heads, 2L, d]``: this rank's two
    chunks (:meth:`SequenceChunks.shard`), query head ``i`` reading K/V head
    ``i // (heads / kv_heads)``, or ``kv_of_head[i]`` when given (any K/V heads).
    ``attention(q, k, v)`` (default: causal SDPA with ``scale``) runs on this rank's heads over
    the whole sequence in order, ``[b, h, s, d]``, with K/V heads ``h / k.shape[1]`` queries
    each. Returns ``[b, heads, 2L, d]``.
    """
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] \
            or q.shape[2:] != k.shape[2:] or (kv_of_head is None and q.shape[1] % k.shape[1]) or q.shape[2] % 2:
        raise ValueError(f"ulysses_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must "
                         "be [b, heads, 2L, d] and [b, kv_heads, 2L, d] with kv_heads dividing heads")
    attention = attention or (lambda q, k, v: _causal_sdpa(q, k, v, scale=scale))
    n, rank = comm.group_size(cp_group), comm.group_rank(cp_group)
    b, heads, s, d = q.shape
    kv_of_head = kv_reads(heads, k.shape[1], kv_of_head)
    split = head_split(heads, k.shape[1], n, kv_of_head=kv_of_head)
    # Per destination rank: its query heads, then the K and V heads they read; heads first.
    sent = torch.cat([torch.cat([q[:, h0:h1], k[:, g0:g1], v[:, g0:g1]], dim=1) for h0, h1, g0, g1 in split],
                     dim=1).transpose(0, 1)
    sizes = [h1 - h0 + 2 * (g1 - g0) for h0, h1, g0, g1 in split]
    mine = sizes[rank]
    received = all_to_all(cp_group, sent, [mine] * n, sizes)                # [n * mine, b, 2L, d]
    order = natural_order(n, s // 2, q.device)
    whole = received.reshape(n, mine, b, s, d).permute(2, 1, 0, 3, 4).reshape(b, mine, n * s, d)
    h0, h1, g0, g1 = split[rank]
    local, local_kv = h1 - h0, g1 - g0
    my_q, my_k, my_v = whole.index_select(2, order).split([local, local_kv, local_kv], dim=1)
    reads = torch.tensor(kv_of_head[h0:h1]) - g0
    if local % local_kv or not reads.equal(torch.arange(local_kv).repeat_interleave(local // local_kv)):
        # This rank's queries read their K/V heads unevenly: one K/V head per query head.
        reads = reads.to(q.device)
        my_k, my_v = my_k.index_select(1, reads), my_v.index_select(1, reads)
    out = attention(my_q, my_k, my_v)                                       # [b, local, n 2L, d]
    back = out.index_select(2, torch.argsort(order)).reshape(b, local, n, s, d).permute(2, 1, 0, 3, 4)
    returned = all_to_all(cp_group, back.reshape(n * local, b, s, d), [stop - first for first, stop, _, _ in split],
                          [local] * n)                                       # [heads, b, 2L, d]
    return returned.transpose(0, 1)
