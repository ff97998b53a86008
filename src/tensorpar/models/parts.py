"""What every part of a GPT is built with: its placement over TP (and CP, EP) and its norm layers."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import comm
from .. import invariant
from ..invariant.lanewise import lanewise
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel_state import default_device, get_tensor_and_context_parallel_group, resolve_ep_group
from . import context_split
from .config import GPTConfig


def _applied(fn, x: torch.Tensor) -> torch.Tensor:
    return fn(x)


def norm(config: GPTConfig, parallel: "Placement") -> nn.Module:
    """A LayerNorm or RMSNorm of ``config`` (the invariant mode's under ``tp_invariant``)."""
    device, sequence_parallel = parallel.device, parallel.sequence_parallel
    kwargs = dict(eps=config.layernorm_epsilon, device=device, dtype=config.params_dtype)
    rms, layer = (nn.RMSNorm, nn.LayerNorm)
    if config.tp_invariant:
        rms, layer = invariant.RMSNorm, invariant.LayerNorm
        # This rank's whole blocks: of its CP chunks, of its SP slice of them.
        kwargs["row_blocks"] = config.invariant_blocks // (parallel.size if sequence_parallel else 1) // parallel.cp_size
        kwargs["tp_group"] = parallel.group if sequence_parallel else None
        kwargs["cp_group"] = parallel.cp_group
    if config.norm == "rmsnorm":
        layer_norm = rms(config.hidden_size, **kwargs)
    else:
        layer_norm = layer(config.hidden_size, bias=config.bias, **kwargs)
    # Under SP each rank normalises its own tokens: the weight grads are partial sums over TP
    # (the invariant norms sum them in backward).
    for param in layer_norm.parameters():
        param.sequence_parallel = sequence_parallel and not config.tp_invariant
    return layer_norm


class Placement:
    """What every submodule needs to know about its TP placement (and CP split, ``context``; the
    expert-parallel group of a model with experts)."""

    def __init__(self, config: GPTConfig, tp_group, device, cp_group=None, ep_group=None) -> None:
        self.group = tp_group
        self.size = comm.group_size(tp_group)
        self.rank = comm.group_rank(tp_group)
        # One rank has no sequence to split.
        self.sequence_parallel = config.sequence_parallel and self.size > 1
        self.context = context_split.over(cp_group, config, tp_size=self.size, sequence_parallel=self.sequence_parallel)
        self.cp_group, self.cp_size = cp_group, 1 if cp_group is None else comm.group_size(cp_group)
        self.ep_group = resolve_ep_group(ep_group) if config.num_moe_experts is not None else None
        # The invariant mode's experts exchange rows over TP x CP where EP is smaller.
        self.expert_exchange_group = None
        if config.tp_invariant and config.num_moe_experts is not None:
            self.expert_exchange_group = tp_group if self.cp_size == 1 else cp_group if self.size == 1 else \
                get_tensor_and_context_parallel_group(check_initialized=False)
        self.device = torch.device(device) if device is not None else default_device()
        self.column, self.row = ((invariant.ColumnLinear, invariant.RowLinear) if config.tp_invariant
                                 else (ColumnParallelLinear, RowParallelLinear))
        # elementwise(fn, x): the invariant mode's takes each element through the same kernel path at every TP size.
        self.elementwise = lanewise if config.tp_invariant else _applied

    def linear_kwargs(self, config: GPTConfig) -> dict:
        # The invariant layers sum their weight grads over the CP ranks' rows themselves.
        return dict(sequence_parallel=self.sequence_parallel,
                    gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                    params_dtype=config.params_dtype, device=self.device, tp_group=self.group,
                    overlap=config.overlap,
                    **({"cp_group": self.cp_group, "blocks": config.invariant_blocks} if config.tp_invariant else {}))
