"""Ring attention (``p2p``): K/V travel around the CP group while each rank attends to the block
in hand; partial outputs are merged by log-sum-exp, so the result is exact causal attention.

Every rank holds two chunks of the sequence (:mod:`tensorpar.context_parallel.chunks`: chunks ``i`` and
``2CP-1-i``) of queries, keys and values. In step ``t`` rank ``r`` holds the K/V of rank
``r - t`` and sends them on to ``r + 1`` while it computes (one ``send_recv`` in flight). A pair
of chunks (query chunk ``a``, key chunk ``c``) is fully visible if ``c < a``, causal on the
diagonal if ``c == a``, and skipped if ``c > a``: with the load-balanced chunks every rank does
the same work in every step. Query heads reading their K/V heads unevenly (``kv_of_head``: a TP
rank's heads of an uneven TP split) are attended one query head per K/V copy, the ring still
carrying each K/V head once. Backward runs the same ring: K/V travel again, and with them the
gradients of K/V accumulated so far (fp32), which after the last step reach their owner.

Collectives per call at CP > 1: forward ``CP - 1`` ``send_recv`` of ``[2, b, G, 2L, d]`` (K and
V); backward ``CP - 1`` of K/V again and ``CP`` of their fp32 gradients.

Example::

    chunks = SequenceChunks.of(seq_len, cp_group=group)
    q, k, v = (chunks.shard(t, dim=2) for t in (q_full, k_full, v_full))   # [b, heads, 2L, d]
    out = ring_attention(q, k, v, cp_group=group)                        # this rank's queries
"""

from __future__ import annotations

import math

import torch

from ..distributed import comm
from .blockwise import block_attention, block_attention_backward, merge
from .chunks import chunk_ids
from .ulysses import kv_reads

_KV_TAG, _GRAD_TAG = 0, 1


def _visible_pairs(cp_size: int, rank: int, source: int):
    """``(query half, key half, causal)`` of every (query chunk, key chunk) pair not skipped."""
    pairs = []
    for a, query_chunk in enumerate(chunk_ids(cp_size, rank)):
        for c, key_chunk in enumerate(chunk_ids(cp_size, source)):
            if key_chunk <= query_chunk:
                pairs.append((a, c, key_chunk == query_chunk))
    return pairs


def _pass_on(tensor: torch.Tensor, group, tag: int) -> comm.Handle:
    n, r = comm.group_size(group), comm.group_rank(group)
    return comm.send_recv(tensor, torch.empty_like(tensor), group, send_to=(r + 1) % n,
                          recv_from=(r - 1) % n, async_op=True, tag=tag)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, reads, keep, dropout_p):
        n, r = comm.group_size(group), comm.group_rank(group)
        b, heads, s, d = q.shape
        groups = k.shape[1]
        half = s // 2
        # [b, G, p, s, d]: the p query heads of each K/V head; uneven reads: [b, heads, 1, s, d].
        queries = (q.unsqueeze(2) if reads is not None else q.reshape(b, groups, heads // groups, s, d)).split(
            half, dim=3)
        out, lse = [None, None], [None, None]
        kv = torch.stack([k, v])
        for step in range(n):
            pending = _pass_on(kv, group, _KV_TAG) if step < n - 1 else None
            keys, values = (t.unsqueeze(2).split(half, dim=3) for t in _per_query(kv, reads))
            source = (r - step) % n
            for a, c, causal in _visible_pairs(n, r, source):
                block = block_attention(queries[a], keys[c], values[c], scale=scale, causal=causal,
                                        drop=_block_drop(keep, dropout_p, queries[a].shape, a, n, source, c))
                out[a], lse[a] = block if out[a] is None else merge(out[a], lse[a], *block)
            if pending is not None:
                kv = pending.wait()
        out, lse = torch.cat(out, dim=3), torch.cat(lse, dim=3)
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.group, ctx.scale, ctx.reads, ctx.dropout_p = group, scale, reads, dropout_p
        return out.view(b, heads, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, out, lse, keep = ctx.saved_tensors
        group, scale, reads, dropout_p = ctx.group, ctx.scale, ctx.reads, ctx.dropout_p
        n, r = comm.group_size(group), comm.group_rank(group)
        b, heads, s, d = q.shape
        half = s // 2
        grad_out = grad_output.float().reshape(out.shape)
        delta = (grad_out * out).sum(dim=-1)
        queries = q.reshape(out.shape).split(half, dim=3)
        grad_outs, deltas, lses = grad_out.split(half, dim=3), delta.split(half, dim=3), lse.split(half, dim=3)
        grad_q = torch.zeros_like(out).split(half, dim=3)
        kv, in_flight = torch.stack([k, v]), None
        for step in range(n):
            pending = _pass_on(kv, group, _KV_TAG) if step < n - 1 else None
            held = _per_query(kv, reads)
            keys, values = (t.unsqueeze(2).split(half, dim=3) for t in held)
            grad_held = held.new_zeros(held.shape, dtype=torch.float32).unsqueeze(3)    # [2, b, G or heads, 1, s, d]
            grad_k, grad_v = grad_held[0].split(half, dim=3), grad_held[1].split(half, dim=3)
            source = (r - step) % n
            for a, c, causal in _visible_pairs(n, r, source):
                drop = _block_drop(keep, dropout_p, queries[a].shape, a, n, source, c)
                dq, dk, dv = block_attention_backward(queries[a], keys[c], values[c], grad_outs[a], lses[a],
                                                      deltas[a], scale=scale, causal=causal, drop=drop)
                grad_q[a].add_(dq)
                grad_k[c].add_(dk)
                grad_v[c].add_(dv)
            grad_kv = grad_held if reads is None else \
                kv.new_zeros(kv.shape, dtype=torch.float32).unsqueeze(3).index_add_(2, reads, grad_held)
            if in_flight is not None:
                # The gradient of these K/V from the ranks they visited before this one.
                grad_kv += in_flight.wait()
            in_flight = _pass_on(grad_kv, group, _GRAD_TAG) if n > 1 else None
            if pending is not None:
                kv = pending.wait()
        grad_kv = (in_flight.wait() if in_flight is not None else grad_kv).squeeze(3)
        grad_q = torch.cat(grad_q, dim=3).view(b, heads, s, d)
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None, None


def _block_drop(keep: torch.Tensor | None, p: float, shape, query_half: int, n: int, source: int, key_half: int):
    """The dropout factor ``keep / (1 - p)`` of (this rank's query chunk ``query_half``, key chunk
    ``key_half`` of rank ``source``), shaped as the block's probabilities (``shape``: its queries')."""
    if keep is None:
        return None
    length = shape[-2]
    first = chunk_ids(n, source)[key_half] * length
    block = keep[..., query_half * length:(query_half + 1) * length, first:first + length]
    return block.reshape(*shape[:-1], length) / (1.0 - p)


def _per_query(kv: torch.Tensor, reads: torch.Tensor | None) -> torch.Tensor:
    """``kv`` ``[2, b, G, s, d]``, or with uneven ``reads`` each query head's K/V head, ``[2, b, heads, s, d]``."""
    return kv if reads is None else kv.index_select(2, reads)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group,
                   scale: float | None = None, kv_of_head=None, keep: torch.Tensor | None = None,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, exact.

    ``q`` ``[b, heads, 2L, d]``, ``k`` and ``v`` ``[b, kv_heads, 2L, d]``: this rank's two
    chunks (:meth:`SequenceChunks.shard`), query head ``i`` reading K/V head
    ``i // (heads / kv_heads)`` (SDPA's ``enable_gqa``), or ``kv_of_head[i]`` when given (any
    K/V heads, in non-decreasing order). ``scale`` defaults to ``1/sqrt(d)``. ``keep``
    (attention dropout at ``dropout_p``): ``[b, heads, 2L, 2 CP L]`` booleans of this rank's
    queries over every key in sequence order. Returns ``[b, heads, 2L, d]``.
    """
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] \
            or q.shape[2:] != k.shape[2:] or (kv_of_head is None and q.shape[1] % k.shape[1]) or q.shape[2] % 2:
        raise ValueError(f"ring_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be "
                         "[b, heads, 2L, d] and [b, kv_heads, 2L, d] with kv_heads dividing heads")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    heads, groups = q.shape[1], k.shape[1]
    reads = kv_reads(heads, groups, kv_of_head)
    uniform = heads % groups == 0 and reads == kv_reads(heads, groups, None)
    reads = None if uniform else torch.tensor(reads, device=q.device)
    return _RingAttention.apply(q, k, v, cp_group, scale, reads, keep, dropout_p)
