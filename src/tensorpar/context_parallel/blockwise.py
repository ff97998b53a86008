"""Exact attention of one (query block, key block) pair with its log-sum-exp, and its backward.

Ring attention sees the keys a block at a time, so each block's softmax is normalised over that
block only; keeping each row's log-sum-exp (in fp32) lets the partial results be merged into
the softmax over every key exactly (:func:`merge`), and lets backward recompute each block's
probabilities of the *whole* softmax from the final log-sum-exp (FlashAttention's backward).
Written out in plain torch: the same code on every device.

Shapes: ``q`` ``[b, G, p, sq, d]`` (``p`` query heads per K/V head), ``k`` and ``v``
``[b, G, 1, sk, d]``; ``causal`` masks key ``j > i`` for query ``i`` (a block on the diagonal).
``drop`` (attention dropout): the block's ``keep / (1 - p)``, ``[b, G, p, sq, sk]``, multiplies
the probabilities of the whole softmax, so the block results still merge exactly (the
log-sum-exp is of the scores, before dropout) and backward is FlashAttention's with dropout.

Example::

    out, lse = block_attention(q, k, v, scale=0.125, causal=True)
    out, lse = merge(out, lse, *block_attention(q, k2, v2, scale=0.125, causal=False))
"""

from __future__ import annotations

import torch


# At most this many scores (query rows x keys) per head at once: a long block's queries are
# taken in tiles of ``max(1, SCORE_TILE // sk)`` rows, so the fp32 scores a pair holds stay
# bounded (at seq 4096 and CP 2, one pair's whole ``L x L`` scores were a third of a rank's peak).
SCORE_TILE = 2**16


def query_rows(sq: int, sk: int) -> int:
    """Query rows per tile of a (``sq`` queries, ``sk`` keys) pair."""
    return min(sq, max(1, SCORE_TILE // sk))


def _tiles(sq: int, sk: int) -> list[slice]:
    rows = query_rows(sq, sk)
    return [slice(start, min(start + rows, sq)) for start in range(0, sq, rows)]


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, causal: bool, first_row: int) -> torch.Tensor:
    """Scores of the block's query rows ``first_row ...`` (``q`` those rows) against ``k``."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril(first_row)
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _rows_of(drop: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if drop is None else drop[..., rows, :]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    causal: bool, drop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: the attention of ``q`` over this block of keys alone, and each row's
    log-sum-exp of scores (fp32, ``[b, G, p, sq]``)."""
    k, v = k.float(), v.float()
    outs, lses = [], []
    for rows in _tiles(q.shape[-2], k.shape[-2]):
        scores = _scores(q[..., rows, :].float(), k, scale=scale, causal=causal, first_row=rows.start)
        lse = scores.logsumexp(dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        tile_drop = _rows_of(drop, rows)
        outs.append((probs if tile_drop is None else probs * tile_drop) @ v)
        lses.append(lse)
    return _joined(outs, -2), _joined(lses, -1)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, as one over both."""
    total = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - total).unsqueeze(-1) + block_out * torch.exp(block_lse - total).unsqueeze(-1),
            total)


def block_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                             lse: torch.Tensor, delta: torch.Tensor, *, scale: float, causal: bool,
                             drop: torch.Tensor | None = None):
    """``(dq, dk, dv)`` of this block (fp32) given the *final* ``lse`` of the queries and
    ``delta = (grad_out * out).sum(-1)`` of the final output; ``dk``/``dv`` summed over the
    ``p`` query heads sharing a K/V head (and over the query tiles)."""
    q, k, v = q.float(), k.float(), v.float()
    grad_q, grad_k, grad_v = [], None, None
    for rows in _tiles(q.shape[-2], k.shape[-2]):
        q_rows, g_out, tile_drop = q[..., rows, :], grad_out[..., rows, :], _rows_of(drop, rows)
        probs = torch.exp(_scores(q_rows, k, scale=scale, causal=causal, first_row=rows.start)
                          - lse[..., rows].unsqueeze(-1))
        grad_probs, dropped = g_out @ v.transpose(-1, -2), probs
        if tile_drop is not None:  # out = (probs * drop) @ v
            dropped, grad_probs = probs * tile_drop, grad_probs * tile_drop
        tile_v = (dropped.transpose(-1, -2) @ g_out).sum(dim=2, keepdim=True)
        grad_scores = probs * (grad_probs - delta[..., rows].unsqueeze(-1)) * scale
        tile_k = (grad_scores.transpose(-1, -2) @ q_rows).sum(dim=2, keepdim=True)
        grad_q.append(grad_scores @ k)
        grad_k = tile_k if grad_k is None else grad_k.add_(tile_k)
        grad_v = tile_v if grad_v is None else grad_v.add_(tile_v)
    return _joined(grad_q, -2), grad_k, grad_v
