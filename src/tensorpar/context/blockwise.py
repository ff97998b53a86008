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


def _scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, causal: bool) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    causal: bool, drop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: the attention of ``q`` over this block of keys alone, and each row's
    log-sum-exp of scores (fp32, ``[b, G, p, sq]``)."""
    scores = _scores(q.float(), k.float(), scale=scale, causal=causal)
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return (probs if drop is None else probs * drop) @ v.float(), lse


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
    ``p`` query heads sharing a K/V head."""
    q, k, v = q.float(), k.float(), v.float()
    probs = torch.exp(_scores(q, k, scale=scale, causal=causal) - lse.unsqueeze(-1))
    grad_probs, dropped = grad_out @ v.transpose(-1, -2), probs
    if drop is not None:  # out = (probs * drop) @ v
        dropped, grad_probs = probs * drop, grad_probs * drop
    grad_v = (dropped.transpose(-1, -2) @ grad_out).sum(dim=2, keepdim=True)
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1)) * scale
    grad_k = (grad_scores.transpose(-1, -2) @ q).sum(dim=2, keepdim=True)
    return grad_scores @ k, grad_k, grad_v
