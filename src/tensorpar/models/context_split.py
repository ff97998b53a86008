"""A GPT over a context-parallel group: each CP rank runs the model on its chunks of every
sequence (:mod:`tensorpar.context_parallel`), attention reaches the other ranks' tokens, and the loss is
the mean over every token of the whole batch.

The GPT calls five things: :func:`shard` (tokens, labels and positions of this rank's chunks,
padded at the end), :func:`dropout_rows` (where those chunks lie, so each token's dropout mask
is its global position's), :func:`embed`, :meth:`ContextSplit.attend` (its attention) and
:func:`mean_loss`. A pipeline stage without the embedding takes the previous stage's chunks
(:func:`stage_rows`: their positions and dropout rows), and the last stage's loss this rank's
labels (:func:`shard_labels`). Weights are the same on every CP rank and each rank's gradients
are its tokens' share: summed over CP (with DP: over DP x CP) they are the CP=1 gradients.

In the TP-invariant mode (``tp_invariant``, ``a2a`` only) the CP size changes no bit: the
embedding runs on the whole sequence and hands each rank its chunks, its backward gathering
the gradient (so its sums over tokens are CP=1's), every other sum over the sequence's rows is
one fixed tree over sequence blocks finished over CP in backward (:mod:`tensorpar.invariant`),
attention runs per query head with the same kernel, and the loss sums its blocks in that tree.

Example::

    model = GPT(GPTConfig.preset("llama-tiny", context_parallel_comm="a2a"), cp_group=group)
    loss = model(tokens, labels)          # the whole batch's mean loss, on every CP rank
    loss.backward()                       # then sum the weight grads over CP
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..distributed import comm
from .. import context_parallel
from ..context_parallel import attention_dropout
from ..tensor_parallel.mappings import (
    gather_from_sequence_parallel_region, reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region)
from ..distributed.tree_reduce import sequence_sum, subtree_sizes, tree_sum
from .config import GPTConfig
from .traced_attention import written_out_attention


def invariant_refusals(config: GPTConfig, *, tp_size: int, cp_size: int, sequence_parallel: bool) -> list[str]:
    """What the TP-invariant mode cannot keep bit-identical under CP, each in words (empty: fine)."""
    if not config.tp_invariant or cp_size == 1:
        return []
    bad = []
    if config.context_parallel_comm != "a2a":
        bad.append("p2p attention (the ring adds the partial attention of each rank's keys in an order that "
                   "depends on the CP size: use a2a)")
    blocks = config.invariant_blocks
    # CP sizes whose ranks' chunks are whole blocks and, in the balanced order, one subtree each.
    served = [n for n in subtree_sizes(blocks) if (blocks // 2) % n == 0]
    if cp_size not in served:
        bad.append(f"CP size {cp_size} (the {blocks} fixed sequence blocks make 2 x CP whole chunks at CP "
                   f"{', '.join(map(str, served[:-1]))} and {served[-1]} only)")
    if sequence_parallel and blocks % (tp_size * cp_size):
        bad.append(f"sequence parallelism at TP {tp_size} x CP {cp_size} (more ranks than the {blocks} fixed "
                   "sequence blocks)")
    if config.attention_dropout > 0:
        bad.append("attention dropout (its keyed masks are not drawn per CP rank yet; --attention-dropout 0 "
                   "keeps the hidden dropout)")
    return bad


class ContextSplit:
    """What a GPT does differently over ``cp_group``; refuses in one line what it cannot do."""

    def __init__(self, config: GPTConfig, cp_group, *, tp_size: int, sequence_parallel: bool) -> None:
        if config.interleave > 1:
            raise ValueError(f"context parallelism does not support interleave={config.interleave!r} yet")
        refused = invariant_refusals(config, tp_size=tp_size, cp_size=comm.group_size(cp_group),
                                     sequence_parallel=sequence_parallel)
        if refused:
            raise ValueError(f"tp_invariant under context parallelism does not support {'; '.join(refused)}")
        if config.context_parallel_comm == "a2a":  # the fewest heads a TP rank has (uneven splits: floor)
            context_parallel.head_split(config.num_heads // tp_size, 1, comm.group_size(cp_group))
        self.config, self.group = config, cp_group
        self.multiple = tp_size if sequence_parallel else 1

    def attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key=None,
               seq_len: int) -> torch.Tensor:
        """``layer``'s :meth:`Attention.attend` (causal) over the CP group: ``[s, b, heads/TP d]`` of
        this rank's tokens of a ``seq_len`` sequence. Its query heads ``first_head..`` read K/V
        heads ``h // p`` of the ones this TP rank holds, unevenly under an uneven TP split (a KV
        head replicated over TP). Attention dropout: for each (head, query, key) this rank
        computes, the mask CP=1 draws there (:mod:`tensorpar.context_parallel.attention_dropout`)."""
        p, first = self.config.queries_per_group, layer.first_head
        kv_of_head = [h // p - first // p for h in range(first, first + layer.local_heads)]
        dropout_p = self.config.attention_dropout if layer.training else 0.0
        if self.config.tp_invariant:  # the kernel of CP = 1 (Attention.attend), a K/V head per query head
            out = context_parallel.ulysses_attention(q, k, v, cp_group=self.group, attention=_causal)
        elif dropout_p > 0:
            out = self._dropped(q, k, v, dropout_p, kv_of_head, heads=range(first, first + layer.local_heads),
                                seq_len=seq_len)
        else:
            out = context_parallel.context_attention(q, k, v, comm_type=self.config.context_parallel_comm,
                                                     cp_group=self.group, kv_of_head=kv_of_head)
        b, _, s, _ = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def chunks(self, seq_len: int) -> context_parallel.SequenceChunks:
        """This rank's chunks of a ``seq_len`` sequence."""
        return context_parallel.SequenceChunks.of(seq_len, cp_group=self.group, multiple=self.multiple)

    def _dropped(self, q, k, v, p: float, kv_of_head: list[int], *, heads: range, seq_len: int) -> torch.Tensor:
        """Attention with dropout over the CP group, ``heads`` this TP rank's global query heads."""
        chunks = self.chunks(seq_len)
        base, padded = attention_dropout.draw_base(), chunks.padded_len
        mask = functools.partial(attention_dropout.keep_mask, base, p, batch=q.shape[0], seq_len=seq_len, keys=padded,
                                 device=q.device)
        if self.config.context_parallel_comm == "p2p":  # this rank's query chunks over every key
            keep = mask(heads=heads, rows=[(c * chunks.chunk_len, chunks.chunk_len) for c in chunks.chunks()])
            return context_parallel.ring_attention(q, k, v, cp_group=self.group, kv_of_head=kv_of_head, keep=keep,
                                                   dropout_p=p)
        # a2a: this CP rank's heads over the whole sequence
        h0, h1, _, _ = context_parallel.head_split(len(heads), k.shape[1], chunks.cp_size,
                                                   kv_of_head=kv_of_head)[chunks.cp_rank]
        drop = functools.partial(attention_dropout.apply, keep=mask(heads=heads[h0:h1], rows=[(0, padded)]), p=p)

        def attention(q, k, v):
            return written_out_attention(q, k, v, mask=None, causal=True, gqa=q.shape[1] != k.shape[1], drop=drop)
        return context_parallel.ulysses_attention(q, k, v, cp_group=self.group, attention=attention,
                                                  kv_of_head=kv_of_head)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


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
    chunks = split.chunks(tokens.shape[1])
    if position_ids is None:
        position_ids = _positions(split, chunks, tokens.device)
    else:
        position_ids = chunks.shard(position_ids, dim=-1)
    return chunks.shard(tokens, dim=1), shard_labels(split, labels), position_ids


def shard_labels(split: ContextSplit | None, labels: torch.Tensor | None) -> torch.Tensor | None:
    """This CP rank's ``labels`` (``[b, s]``; padding -100), unchanged without CP."""
    if split is None or labels is None:
        return labels
    return split.chunks(labels.shape[1]).shard(labels, dim=1, pad_value=-100)


def stage_rows(split: ContextSplit, x: torch.Tensor, seq_len: int | None) -> tuple[dict, torch.Tensor]:
    """A pipeline stage's input ``x`` (``[rows(/TP), b, h]``) as this rank's chunks of a ``seq_len``
    sequence: their :func:`dropout_rows` and position ids, what the first stage had for them."""
    if seq_len is None:
        raise ValueError("a pipeline stage without the embedding under context parallelism needs the "
                         "sequence_length its input holds this CP rank's chunks of")
    chunks = split.chunks(seq_len)
    rows = x.shape[0] * split.multiple  # under SP: x is this TP rank's slice
    if rows != chunks.local_len:
        raise ValueError(f"a pipeline stage's input of {rows} rows is not this CP rank's {chunks.local_len} "
                         f"tokens of a {seq_len}-token sequence")
    return dropout_rows(split, seq_len), _positions(split, chunks, x.device)


def _positions(split: ContextSplit, chunks: context_parallel.SequenceChunks, device) -> torch.Tensor:
    # The padding's positions are past the sequence: any the tables hold will do.
    return chunks.positions(device).clamp(max=split.config.max_seq_len - 1)


def dropout_rows(split: ContextSplit | None, seq_len: int) -> dict:
    """The hidden dropout's placement of this CP rank's rows of a ``seq_len`` sequence
    (:func:`tensorpar.tensor_parallel.random.dropout` ``valid_rows``, ``row_starts``): each token's mask is its
    global position's, as at CP=1; empty without CP."""
    if split is None:
        return {}
    chunks = split.chunks(seq_len)
    return {"valid_rows": seq_len, "row_starts": tuple(c * chunks.chunk_len for c in chunks.chunks())}


def embed(model, tokens, position_ids, key, rows, *, whole) -> torch.Tensor:
    """``model.embedding`` of this rank's ``tokens``; in the invariant mode under CP of the
    ``whole`` (tokens, position ids) sequence, this rank's chunks of it (:meth:`SequenceChunks.scatter`,
    under SP this TP rank's slice of them): the token and position embeddings' grads are then
    summed over the tokens as at CP = 1."""
    split = model.parallel.context
    if split is None or not split.config.tp_invariant:
        return model.embedding(tokens, position_ids, key, rows)
    tokens, position_ids = whole
    seq_len, parallel = tokens.shape[1], model.parallel
    chunks = split.chunks(seq_len)
    if chunks.padding:  # padding would move the fixed blocks' boundaries
        raise ValueError(f"tp_invariant under context parallelism: the sequence length {seq_len} is not divisible "
                         f"by 2 x CP{' x TP' if split.multiple > 1 else ''} = {2 * chunks.cp_size * split.multiple}")
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=tokens.device)
    x = model.embedding(tokens, position_ids, key)                 # [s(/TP), b, h], as at CP = 1
    if parallel.sequence_parallel:  # backward: this TP rank's slice of the gathered gradient
        x = gather_from_sequence_parallel_region(x, False, group=parallel.group)
    x = chunks.scatter(x, dim=0, cp_group=split.group)
    return scatter_to_sequence_parallel_region(x, group=parallel.group) if parallel.sequence_parallel else x


def _ordered_sum(losses: torch.Tensor, split: ContextSplit | None, blocks: int) -> torch.Tensor:
    """The sum of ``losses`` (``[s, b]``, this rank's rows) in the invariant mode's sequence tree
    of ``blocks``, over every CP rank: each rank's subtree placed at its rank and all-reduced
    (adding zeros, exact), then the rank-order tree. Differentiable (backward: each rank its own tokens')."""
    here = blocks // (1 if split is None else comm.group_size(split.group))
    if losses.shape[0] % here:
        raise ValueError(f"tp_invariant: this rank's sequence length {losses.shape[0]} is not divisible by its "
                         f"{here} fixed sequence blocks (the sequence length must divide by {blocks})")
    mine = sequence_sum(block.sum() for block in losses.chunk(here))
    if split is None:
        return mine
    rank, size = comm.group_rank(split.group), comm.group_size(split.group)
    placed = torch.stack([mine if r == rank else torch.zeros_like(mine) for r in range(size)])
    everyone = reduce_from_tensor_model_parallel_region(placed, group=split.group)
    return tree_sum(part.clone() for part in everyone.unbind())


def mean_loss(losses: torch.Tensor, labels: torch.Tensor, split: ContextSplit | None, *,
              invariant_blocks: int | None = None) -> torch.Tensor:
    """The mean of ``losses`` (``[s, b]``) over the labelled tokens of every CP rank, on each.

    The sum is all-reduced forward and not backward: each rank's gradient is its own tokens'.
    ``invariant_blocks`` (the TP-invariant mode's): summed in one fixed tree of that many
    sequence blocks at every CP size (:func:`_ordered_sum`).
    """
    count = (labels != -100).sum()
    if split is not None:
        count = comm.all_reduce(count, split.group)
    # A sequence of partial blocks is no training sequence (the norms refuse it): its plain sum.
    if invariant_blocks and (split is not None or losses.shape[0] % invariant_blocks == 0):
        return _ordered_sum(losses, split, invariant_blocks) / count
    if split is None:
        return losses.sum() / count
    return reduce_from_tensor_model_parallel_region(losses.sum(), group=split.group) / count
