"""A GPT over a context-parallel group: each CP rank runs the model on its chunks of every
sequence (:mod:`tensorpar.context`), attention reaches the other ranks' tokens, and the loss is
the mean over every token of the whole batch.

The GPT calls four things: :func:`shard` (tokens, labels and positions of this rank's chunks,
padded at the end), :func:`dropout_rows` (where those chunks lie, so each token's dropout mask
is its global position's), :meth:`ContextSplit.attend` (its attention) and :func:`mean_loss`. Weights
are the same on every CP rank and each rank's gradients are its tokens' share: summed over CP
(with DP: over DP x CP) they are the CP=1 gradients.

Example::

    model = GPT(GPTConfig.preset("llama-tiny", context_parallel_comm="a2a"), cp_group=group)
    loss = model(tokens, labels)          # the whole batch's mean loss, on every CP rank
    loss.backward()                       # then sum the weight grads over CP
"""

from __future__ import annotations

import torch

from .. import comm, context
from ..mappings import reduce_from_tensor_model_parallel_region
from .config import GPTConfig


class ContextSplit:
    """What a GPT does differently over ``cp_group``; refuses in one line what it cannot do."""

    def __init__(self, config: GPTConfig, cp_group, *, tp_size: int, sequence_parallel: bool) -> None:
        unsupported = {"attention_dropout": config.attention_dropout > 0,
                       "tp_invariant": config.tp_invariant, "interleave": config.interleave > 1,
                       "heads or KV heads TP does not divide": config.num_heads % tp_size
                       or config.num_query_groups % tp_size}
        named = [name if name.startswith("heads") else f"{name}={getattr(config, name)!r}"
                 for name, bad in unsupported.items() if bad]
        if named:
            raise ValueError(f"context parallelism does not support {', '.join(named)} yet")
        if config.context_parallel_comm == "a2a":
            context.head_split(config.num_heads // tp_size, config.num_query_groups // tp_size,
                               comm.group_size(cp_group))
        self.config, self.group = config, cp_group
        self.multiple = tp_size if sequence_parallel else 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, *, causal: bool,
               key=None) -> torch.Tensor:
        """:meth:`Attention.attend` over the CP group: ``[s, b, heads/TP d]`` of this rank's tokens."""
        out = context.context_attention(q, k, v, comm_type=self.config.context_parallel_comm, cp_group=self.group)
        b, _, s, _ = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def over(cp_group, config: GPTConfig, *, tp_size: int, sequence_parallel: bool) -> ContextSplit | None:
    """The GPT's :class:`ContextSplit` over ``cp_group`` (None: no context parallelism)."""
    if cp_group is None:
        return None
    return ContextSplit(config, cp_group, tp_size=tp_size, sequence_parallel=sequence_parallel)


def shard(model, tokens, labels, position_ids, attn_mask, kv_cache):
    """This CP rank's ``tokens``, ``labels`` (padding: -100) and ``position_ids`` (default: the
    chunks' positions) for ``model`` (a GPT), unchanged without CP; a mask or KV cache
    (generation) is refused."""
    split = model.parallel.context
    if split is None:
        return tokens, labels, position_ids
    if attn_mask is not None or kv_cache is not None:
        raise ValueError("context parallelism runs training and evaluation only: no attn_mask or "
                         "kv_cache (generate from the checkpoint without CP)")
    chunks = context.SequenceChunks.of(tokens.shape[1], cp_group=split.group, multiple=split.multiple)
    if position_ids is None:
        position_ids = chunks.positions(tokens.device).clamp(max=split.config.max_seq_len - 1)
    else:
        position_ids = chunks.shard(position_ids, dim=-1)
    labels = None if labels is None else chunks.shard(labels, dim=1, pad_value=-100)
    return chunks.shard(tokens, dim=1), labels, position_ids


def dropout_rows(split: ContextSplit | None, seq_len: int) -> dict:
    """The hidden dropout's placement of this CP rank's rows of a ``seq_len`` sequence
    (:func:`tensorpar.random.dropout` ``valid_rows``, ``row_starts``): each token's mask is its
    global position's, as at CP=1; empty without CP."""
    if split is None:
        return {}
    chunks = context.SequenceChunks.of(seq_len, cp_group=split.group, multiple=split.multiple)
    return {"valid_rows": seq_len, "row_starts": tuple(c * chunks.chunk_len for c in chunks.chunks())}


def mean_loss(losses: torch.Tensor, labels: torch.Tensor, split: ContextSplit | None) -> torch.Tensor:
    """The mean of ``losses`` over the labelled tokens of every CP rank, on each.

    The sum is all-reduced forward and not backward: each rank's gradient is its own tokens'.
    """
    count = (labels != -100).sum()
    if split is None:
        return losses.sum() / count
    count = comm.all_reduce(count, split.group)
    return reduce_from_tensor_model_parallel_region(losses.sum(), group=split.group) / count
