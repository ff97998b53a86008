"""Evaluation during training: the mean validation loss over fixed batches, and the autocast
every forward pass of a run computes under."""

from __future__ import annotations

import contextlib

import torch

from ..distributed import comm
from .data import BatchSampler


def autocast(dtype: str, device: torch.device):
    """Autocast to bfloat16 for ``--dtype bf16`` (the weights stay fp32); nothing for fp32."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, sampler: BatchSampler, *, iters: int, dtype: str, device, dp_group) -> float:
    """Mean validation loss over ``iters`` fixed batches, averaged over DP."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(iters):
        (tokens, labels), = sampler.micro_batches(i)
        with autocast(dtype, device):
            total += model(tokens.to(device), labels.to(device)).double()
    model.train()
    comm.all_reduce(total, dp_group)
    return float(total) / (iters * comm.group_size(dp_group))
