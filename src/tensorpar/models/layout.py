"""How a model's parameters are laid out over TP, and TP-independent (full) state dicts.

Every parameter of a module built from tensorpar layers carries ``tensor_model_parallel``,
``partition_dim`` and ``partition_stride``. A sharded parameter with stride ``k`` holds, along
``partition_dim``, this rank's slice of each of ``k`` equal blocks (Q|K|V for ``k=3``), so the
full tensor is rebuilt block by block, not by plain concatenation. A replicated parameter is
the same on every rank (``sequence_parallel`` ones once their grads are summed).

Example::

    full = full_state_dict(model, tp_group=group)   # the TP=1 tensors, on every rank
    load_full_state_dict(other_tp_model, full, tp_group=other_group)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import comm
from ..parallel_state import resolve_tp_group


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One parameter: its shard on this rank and the full (TP=1) shape it belongs to."""

    name: str
    param: nn.Parameter
    tensor_model_parallel: bool
    partition_dim: int
    partition_stride: int
    sequence_parallel: bool
    full_shape: tuple[int, ...]


def parameter_layouts(module: nn.Module, *, tp_group=None) -> list[ParamLayout]:
    """Every parameter of ``module`` (shared ones once) with its TP layout."""
    group = resolve_tp_group(tp_group)
    layouts = []
    for name, param in module.named_parameters():
        parallel = getattr(param, "tensor_model_parallel", False)
        dim = getattr(param, "partition_dim", -1)
        full_shape = list(param.shape)
        if parallel:
            full_shape[dim] *= comm.group_size(group)
        layouts.append(ParamLayout(name, param, parallel, dim, getattr(param, "partition_stride", 1),
                                   getattr(param, "sequence_parallel", False), tuple(full_shape)))
    return layouts


def gather_full_tensor(tensor: torch.Tensor, *, partition_dim: int, stride: int = 1,
                       tp_group=None) -> torch.Tensor:
    """The full tensor from every rank's shard (one all-gather), on every rank."""
    group = resolve_tp_group(tp_group)
    n = comm.group_size(group)
    if n == 1:
        return tensor.detach().clone()
    gathered = comm.all_gather(tensor.detach().contiguous(), group, dim=partition_dim)
    per_rank = [shard.chunk(stride, dim=partition_dim) for shard in gathered.chunk(n, dim=partition_dim)]
    return torch.cat([per_rank[r][block] for block in range(stride) for r in range(n)], dim=partition_dim)


def shard_full_tensor(full: torch.Tensor, *, partition_dim: int, stride: int = 1,
                      tp_group=None) -> torch.Tensor:
    """This rank's shard of ``full`` (no communication)."""
    group = resolve_tp_group(tp_group)
    n, rank = comm.group_size(group), comm.group_rank(group)
    comm.check_divisible(full.shape[partition_dim], n * stride,
                         f"partition dimension {partition_dim} of shape {list(full.shape)} over stride {stride}")
    pieces = full.chunk(n * stride, dim=partition_dim)
    return torch.cat([pieces[block * n + rank] for block in range(stride)], dim=partition_dim)


def full_state_dict(module: nn.Module, *, tp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full shape (one all-gather per sharded parameter)."""
    return {layout.name: gather_full_tensor(layout.param, partition_dim=layout.partition_dim,
                                            stride=layout.partition_stride, tp_group=tp_group)
            if layout.tensor_model_parallel else layout.param.detach().clone()
            for layout in parameter_layouts(module, tp_group=tp_group)}


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor], *, tp_group=None) -> None:
    """Copy full tensors (as :func:`full_state_dict` returns) into this rank's shards.

    The keys must be exactly the module's parameter names, the shapes the full shapes.
    """
    layouts = parameter_layouts(module, tp_group=tp_group)
    expected = {layout.name for layout in layouts}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"full state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for layout in layouts:
        full = state[layout.name]
        if tuple(full.shape) != layout.full_shape:
            raise ValueError(f"{layout.name}: full tensor has shape {list(full.shape)}, "
                             f"expected {list(layout.full_shape)}")
        if layout.tensor_model_parallel:
            full = shard_full_tensor(full, partition_dim=layout.partition_dim,
                                     stride=layout.partition_stride, tp_group=tp_group)
        layout.param.copy_(full)
