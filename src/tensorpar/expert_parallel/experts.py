"""Routed experts: SwiGLU MLPs held as stacked weights, one GEMM per layer for all of them.

This rank holds experts ``first_expert .. first_expert + num_local_experts - 1``, a contiguous
slice of the ``num_experts`` (all of them at EP = 1). Each expert's weights are the same at every
EP size (drawn by expert, as TP shards are drawn by row). ``torch._grouped_mm`` multiplies each
expert's rows by its weights in one call where it applies; elsewhere an exact loop over the
experts does (on CPU the two give the same bits). It does not apply where a weight's rows are
not a multiple of 16 bytes, for no rows, nor on CUDA below compute capability 9.0 or outside bf16.
Under autocast the experts compute in its dtype, as a linear layer would.

Example::

    experts = GroupedExperts(8, hidden_size=512, ffn_hidden_size=1024, ep_group=ep_group)
    out = experts(rows, rows_per_expert)        # rows [R, h] grouped by local expert
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from ..tensor_parallel.initialization import init_method_normal, init_weight_shard


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: grouped GEMM refuses a stride-0 one."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def swiglu(hidden: torch.Tensor) -> torch.Tensor:
    """An expert's activation of its ``gate_up`` output: SiLU of the gate half times the up half."""
    gate, up = hidden.chunk(2, dim=-1)
    return F.silu(gate) * up


def _grouped_mm_applies(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    # (its backward refuses zero rows)
    if not hasattr(torch, "_grouped_mm") or len(rows) == 0:
        return False
    if rows.device.type == "cuda":
        if rows.dtype != torch.bfloat16 or torch.cuda.get_device_capability(rows.device) < (9, 0):
            return False
    elif rows.device.type != "cpu" or torch.compiler.is_compiling() and rows.dtype != torch.bfloat16:
        return False  # (the compiler's shape rule for it takes bf16 only)
    return all(w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0
               for w in weights)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts sharded over ``ep_group``: ``gate_up`` ``[E/EP, 2 ffn, h]``
    (each expert's gate rows, then its up rows) and ``down`` ``[E/EP, h, ffn]``.

    ``forward(rows [R, h], rows_per_expert [E/EP])``: the rows grouped by local expert, in
    order, ``rows_per_expert[i]`` of them for local expert ``i`` (zero is fine).
    """

    def __init__(self, num_experts: int, *, hidden_size: int, ffn_hidden_size: int, ep_group=None,
                 init_method=None, output_init_method=None, params_dtype=torch.float32, device=None) -> None:
        super().__init__()
        ep_size, ep_rank = (1, 0) if ep_group is None else (comm.group_size(ep_group), comm.group_rank(ep_group))
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over expert-parallel size {ep_size}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        self.ffn_hidden_size = ffn_hidden_size
        init_method = init_method or init_method_normal(0.02)
        output_init_method = output_init_method or init_method
        kwargs = dict(dtype=params_dtype, device=device)
        self.gate_up = nn.Parameter(torch.empty(self.num_local_experts, 2 * ffn_hidden_size, hidden_size, **kwargs))
        self.down = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, ffn_hidden_size, **kwargs))
        for weight, init in ((self.gate_up, init_method), (self.down, output_init_method)):
            init_weight_shard(weight, init, partition_dim=0, tp_group=ep_group)
            weight.allreduce = False             # Megatron's mark: reduced over expert-DP, not DP
            weight.expert_parallel = True
            weight.num_experts = num_experts

    def forward(self, rows: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up, self.down
        # As autocast runs a linear layer: grouped GEMM is not on its list.
        if torch.is_autocast_enabled(rows.device.type):
            dtype = torch.get_autocast_dtype(rows.device.type)
            rows, gate_up, down = rows.to(dtype), gate_up.to(dtype), down.to(dtype)
        if _grouped_mm_applies(rows, gate_up, down):
            offsets = rows_per_expert.cumsum(0).to(torch.int32)
            hidden = torch._grouped_mm(rows.contiguous(), gate_up.transpose(-2, -1), offs=offsets)
            out = torch._grouped_mm(swiglu(hidden), down.transpose(-2, -1), offs=offsets)
            return _DenseGrad.apply(out)
        chunks = rows.split(rows_per_expert.tolist())
        return torch.cat([F.linear(swiglu(F.linear(chunk, w1)), w2)
                          for chunk, w1, w2 in zip(chunks, gate_up, down)])
