"""Cross-entropy over logits sharded along the vocabulary, without gathering them.

Each TP rank holds ``[..., V/TP]`` columns of the logits. The softmax normaliser needs only
per-token scalars from the other ranks (the max, the sum of exponentials, the target's
logit), so two all-reduces of ``[...]``-sized tensors replace an all-gather of ``[..., V]``.

Example::

    logits = lm_head(h)                                   # [s, b, V/TP]
    loss = tp.vocab_parallel_cross_entropy(logits, labels)   # [s, b], fp32
    loss.mean().backward()
"""

from __future__ import annotations

import torch

from ..distributed import comm
from ..errors import check_index_range
from ..parallel_state import resolve_tp_group


def _padding_mask(local_vocab: int, vocab_start: int, vocab_size: int, device) -> torch.Tensor | None:
    """True for this rank's columns at global index >= ``vocab_size`` (None when there are none)."""
    if vocab_start + local_vocab <= vocab_size:
        return None
    return torch.arange(vocab_start, vocab_start + local_vocab, device=device) >= vocab_size


def _local_target(target, vocab_start, local_vocab, ignore_index):
    """The target's column in this shard (0 where another rank owns it) and where we own it."""
    owned = (target >= vocab_start) & (target < vocab_start + local_vocab) & (target != ignore_index)
    return (target - vocab_start).masked_fill(~owned, 0), owned


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, group, vocab_size, sum_stats=None):
        # sum_stats(exp, stats): [sum of exp over the vocabulary, *stats], each summed over TP;
        # tensorpar.invariant's sums them in fixed trees.
        sum_stats = sum_stats or (lambda exp, stats: comm.all_reduce(torch.stack([exp.sum(dim=-1), *stats]), group))
        local_vocab = logits.shape[-1]
        vocab_start = comm.group_rank(group) * local_vocab
        pad = _padding_mask(local_vocab, vocab_start, vocab_size, logits.device)
        # One fp32 copy, worked on in place: the caller's logits stay untouched (they may feed
        # other losses), and no other [..., V/TP] temporary is made.
        x = logits.to(torch.float32, copy=True)
        if pad is not None:
            x.masked_fill_(pad, float("-inf"))

        row_max = x.amax(dim=-1)
        comm.all_reduce(row_max, group, op="max")

        shifted = x.sub_(row_max.unsqueeze(-1))
        local_t, owned = _local_target(target, vocab_start, local_vocab, ignore_index)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        stats = [target_logit]
        if label_smoothing > 0:
            if pad is not None:
                shifted.masked_fill_(pad, 0.0)
            stats.append(shifted.sum(dim=-1))
        exp = shifted.exp_()
        if label_smoothing > 0 and pad is not None:
            exp.masked_fill_(pad, 0.0)      # exp(0) of the padding zeroed above
        stats = sum_stats(exp, stats)

        log_z = stats[0].log()
        loss = log_z - stats[1]
        if label_smoothing > 0:
            # Mean over the whole real vocabulary of -log p, as torch.nn.functional.cross_entropy.
            smooth = log_z - stats[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        valid = target != ignore_index
        loss = loss.masked_fill(~valid, 0.0)

        ctx.save_for_backward(logits, target, row_max + log_z)
        ctx.label_smoothing, ctx.ignore_index, ctx.vocab_size = label_smoothing, ignore_index, vocab_size
        ctx.vocab_start = vocab_start
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, log_normalizer = ctx.saved_tensors
        local_vocab = logits.shape[-1]
        eps = ctx.label_smoothing
        pad = _padding_mask(local_vocab, ctx.vocab_start, ctx.vocab_size, logits.device)
        # Recomputing the softmax from the saved input costs one exp but keeps no [..., V/TP]
        # fp32 copy alive between forward and backward.
        x = logits.float()
        if pad is not None:
            x = x.masked_fill(pad, float("-inf"))
        grad = (x - log_normalizer.unsqueeze(-1)).exp_()
        local_t, owned = _local_target(target, ctx.vocab_start, local_vocab, ctx.ignore_index)
        if eps > 0:
            smooth = eps / ctx.vocab_size
            grad.sub_(smooth if pad is None else (~pad) * smooth)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - eps) * owned.unsqueeze(-1).to(grad.dtype))
        scale = grad_loss.float().masked_fill(target == ctx.ignore_index, 0.0)
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(logits.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, ignore_index: int = -100,
                                 tp_group=None, *, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shaped like ``target``) of vocab-sharded logits.

    ``vocab_parallel_logits`` is ``[..., V/TP]``: this rank's contiguous slice of the vocabulary.
    Matches ``F.cross_entropy(full_logits.float().flatten(0, -2), target.flatten(),
    reduction='none', label_smoothing=..., ignore_index=...)`` at every TP size: smoothing
    averages over the whole real vocabulary, ignored tokens get loss 0 and zero gradient.
    ``vocab_size`` is the real vocabulary when the logits are padded: columns at global index
    ``>= vocab_size`` get no probability and zero gradient. Computes in fp32; the gradient has
    the logits' dtype. The caller's logits are never modified.

    Collectives (TP > 1, ``N = target.numel()``): forward exactly two all-reduces, both fp32:
    ``op="max"`` of shape ``target.shape`` (4N bytes), then ``op="sum"`` of shape
    ``[2, *target.shape]`` (8N bytes), ``[3, *target.shape]`` (12N bytes) with label smoothing.
    Backward: none.

    Example::

        loss = vocab_parallel_cross_entropy(logits_shard, labels, label_smoothing=0.1)
    """
    group = resolve_tp_group(tp_group)
    tp_size = comm.group_size(group)
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits of shape {list(vocab_parallel_logits.shape)} need a target of shape "
                         f"{list(vocab_parallel_logits.shape[:-1])}, got {list(target.shape)}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    if not vocab_parallel_logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {vocab_parallel_logits.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    padded_vocab = vocab_parallel_logits.shape[-1] * tp_size
    if vocab_size is None:
        vocab_size = padded_vocab
    elif not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size ({vocab_size}) must be in [1, {padded_vocab}], the TP size "
                         f"({tp_size}) times the local vocab ({vocab_parallel_logits.shape[-1]})")
    _check_targets(target, ignore_index, vocab_size)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing),
                                            ignore_index, group, vocab_size)


def _check_targets(target: torch.Tensor, ignore_index: int, vocab_size: int) -> None:
    # A bad id would otherwise give a finite, wrong loss.
    check_index_range(target, vocab_size, "target value",
                      f"out of range for vocab_size {vocab_size} (valid: 0..{vocab_size - 1}, "
                      f"or ignore_index={ignore_index})", ignore=ignore_index)
