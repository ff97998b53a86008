"""The TP-invariant mode's training step at any DP size: everything a function of the global
micro-batch index, nothing of the rank.

With the global batch and micro-batch size fixed, a step has ``M = global_batch / micro_batch``
micro-batches, numbered ``0 .. M-1``; micro-batch ``j`` holds the same windows at every DP size
(:class:`~.data.BatchSampler` with ``rank_contiguous``), and DP rank ``r`` runs ``[r A, (r+1) A)``
(``A = M / DP``, its gradient accumulation). Each backward is of the loss divided by ``M`` (one
fixed division), the gradients of the ``M`` micro-batches are summed in one fixed tree whose
rank ``r`` part is a subtree (``DataParallelGradReducer(micro_batches=A)``), micro-batch ``j``'s
dropout masks are keyed by ``step x M + j``, and the reported loss and the evaluation add the
micro-batches' losses in index order. So the DP size joins the TP size as free.

Example::

    model.dropout_masks.counter = first_micro_batch(step, grad_accum=A, dp_size=D, dp_rank=r)
    mean = mean_by_index(losses, indices=range(r * A, (r + 1) * A), total=A * D, dp_group=dp, device=device)
"""

from __future__ import annotations

import dataclasses

import torch

from ..distributed import comm
from ..data_parallel.fsdp import is_fully_sharded
from .data import BatchSampler
from .evaluation import autocast


def first_micro_batch(step: int, *, grad_accum: int, dp_size: int, dp_rank: int) -> int:
    """The global index of DP rank ``dp_rank``'s first micro-batch of ``step``, counted from the
    run's start: what the dropout masks are keyed by (the same at any DP size, and on a resume)."""
    return (step * dp_size + dp_rank) * grad_accum


def mean_by_index(values: list[torch.Tensor], *, indices, total: int, dp_group, device) -> torch.Tensor:
    """The mean (fp64) of ``total`` values, this DP rank's ``values`` at ``indices`` and the other
    ranks' at theirs, added in index order: the same bits at any DP size. Each index is filled on
    one rank only, so the all-reduce adds zeros (exact) and the order of the sum is fixed here."""
    everyone = torch.zeros(total, dtype=torch.float64, device=device)
    if values:
        everyone[list(indices)] = torch.stack(values).double()
    comm.all_reduce(everyone, dp_group)
    summed = torch.zeros((), dtype=torch.float64, device=device)
    for value in everyone.unbind():  # one add at a time, as the default mode's loss sum
        summed += value
    return summed / total


@torch.no_grad()
def evaluate(model, sampler: BatchSampler, *, iters: int, dtype: str, device, dp_group) -> float:
    """The mean validation loss over the ``iters`` micro-batches ``sampler`` draws at DP = 1, the
    DP ranks running consecutive shares of them: the same value at any DP size (and PP size: a
    pipeline's ``losses`` runs its share through the schedule)."""
    size, rank = comm.group_size(dp_group), comm.group_rank(dp_group)
    single = dataclasses.replace(sampler, dp_rank=0, dp_size=1)
    share = -(-iters // size)
    indices = range(rank * share, min((rank + 1) * share, iters))
    batches = [single.micro_batches(i)[0] for i in indices]
    # Under FSDP each forward all-gathers over DP, and experts exchange tokens over EP (which
    # spans DP ranks): a rank with a shorter share runs as many, the extra ones on batch 0
    # again, their losses unused.
    collective = is_fully_sharded(model) or any(getattr(p, "expert_parallel", False) for p in model.parameters())
    padded = batches + [single.micro_batches(0)[0]] * (share - len(batches) if collective else 0)
    model.eval()
    if hasattr(model, "losses"):  # a pipeline (training.pipeline_step.PipelinedGPT)
        losses = model.losses(padded, dtype=dtype)
    else:
        losses = []
        for tokens, labels in padded:
            with autocast(dtype, device):
                losses.append(model(tokens.to(device), labels.to(device)))
    del losses[len(batches):]
    model.train()
    return float(mean_by_index(losses, indices=indices, total=iters, dp_group=dp_group, device=device))
