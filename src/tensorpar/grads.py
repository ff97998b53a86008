"""Gradient bookkeeping after backward that TP layers need from the training loop."""

from __future__ import annotations

import torch
from torch import nn

from . import comm
from .parallel_state import resolve_tp_group


def _grad_of(param: nn.Parameter) -> torch.Tensor | None:
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def allreduce_sequence_parallel_grads(module: nn.Module, *, tp_group=None) -> None:
    """Sum over TP the gradients of parameters marked ``sequence_parallel``.

    Under SP each rank sees 1/TP of the tokens, so the gradient of a parameter replicated over
    TP (LayerNorm weights, the row-parallel bias) is partial until summed. One all-reduce of a
    flat buffer covers all of them. Uses ``main_grad`` where a parameter has one.
    """
    group = resolve_tp_group(tp_group)
    grads = [g for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and (g := _grad_of(p)) is not None]
    if not grads or comm.group_size(group) == 1:
        return
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        comm.all_reduce(flat, group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
