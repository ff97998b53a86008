"""How a model's parameters are laid out over TP, and TP-independent (full) state dicts.

Every parameter of a module built from tensorpar layers carries ``tensor_model_parallel``,
``partition_dim`` and ``partition_stride``. A sharded parameter with stride ``k`` holds, along
``partition_dim``, this rank's slice of each of ``k`` equal blocks (Q|K|V for ``k=3``), so the
full tensor is rebuilt block by block, not by plain concatenation. A parameter with
``partition_rows`` (an uneven layout) lists every rank's ``[start, stop)`` rows of the full
tensor instead; rows several ranks hold are the same on each. A replicated parameter is the
same on every rank (``sequence_parallel`` ones once their grads are summed).

Example::

    full = full_state_dict(model, tp_group=group)   # the TP=1 tensors, on every rank
    load_full_state_dict(other_tp_model, full, tp_group=other_group)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..distributed import comm
from ..tensor_parallel.initialization import balanced_sizes, shard_rows
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
    partition_rows: tuple | None = None

    def ranges(self, rank: int, tp_size: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` rows of the full partition dimension that ``rank`` holds, in order."""
        if self.partition_rows is not None:
            return list(self.partition_rows[rank])
        dim = self.partition_dim % len(self.full_shape)
        return shard_rows(self.full_shape[dim], tp_size, rank, self.partition_stride)


def attention_layout(num_heads: int, num_groups: int, head_dim: int, tp_size: int, *, all_kv: bool = False):
    """How attention splits over TP: per rank, its query heads ``[first, stop)`` and the
    ``[start, stop)`` rows it holds of the fused QKV weight.

    The fused weight is ``p + 2`` blocks of ``num_groups`` heads (``p`` query heads per group:
    block ``j < p`` holds every group's ``j``-th query head, then K, then V). Query heads are
    split as evenly as possible in contiguous runs; a rank holds the K/V heads its queries use
    (``all_kv``: every K/V head), so a K/V head is replicated on every rank whose queries read it.

    Example::

        attention_layout(6, 2, 4, 4)[3]   # ((5, 6), [(20, 24), (28, 32), (36, 40)])
    """
    p = num_heads // num_groups
    layout, first = [], 0
    for size in balanced_sizes(num_heads, tp_size):
        heads = range(first, first + size)
        g0, g1 = first // p, (first + size - 1) // p + 1
        rows = [(((h % p) * num_groups + h // p) * head_dim, ((h % p) * num_groups + h // p + 1) * head_dim)
                for h in heads]
        if all_kv:
            g0, g1 = 0, num_groups
        rows += [((block * num_groups + g0) * head_dim, (block * num_groups + g1) * head_dim) for block in (p, p + 1)]
        layout.append(((first, first + size), rows))
        first += size
    return layout


def parameter_layouts(module: nn.Module, *, tp_group=None) -> list[ParamLayout]:
    """Every parameter of ``module`` (shared ones once) with its TP layout."""
    group = resolve_tp_group(tp_group)
    layouts = []
    for name, param in module.named_parameters():
        parallel = getattr(param, "tensor_model_parallel", False)
        dim = getattr(param, "partition_dim", -1)
        full_shape = list(param.shape)
        rows = getattr(param, "partition_rows", None) if parallel else None
        if rows is not None:
            full_shape[dim] = max(b for ranges in rows for _, b in ranges)
        elif parallel:
            full_shape[dim] *= comm.group_size(group)
        layouts.append(ParamLayout(name, param, parallel, dim, getattr(param, "partition_stride", 1),
                                   getattr(param, "sequence_parallel", False), tuple(full_shape), rows))
    return layouts


def gather_full_tensor(tensor: torch.Tensor, *, partition_dim: int, stride: int = 1,
                       tp_group=None, partition_rows=None) -> torch.Tensor:
    """The full tensor from every rank's shard (one all-gather), on every rank.

    ``partition_rows``: every rank's rows, for an uneven layout (see the module's docstring).
    """
    group = resolve_tp_group(tp_group)
    n = comm.group_size(group)
    if n == 1 and partition_rows is None:
        return tensor.detach().clone()
    if partition_rows is not None:
        dim = partition_dim % tensor.dim()
        sizes = [sum(b - a for a, b in ranges) for ranges in partition_rows]
        gathered = comm.all_gather(tensor.detach().contiguous(), group, dim=dim, sizes=sizes)
        shape = list(tensor.shape)
        shape[dim] = max(b for ranges in partition_rows for _, b in ranges)
        full = tensor.new_empty(shape)
        for piece, ranges in zip(gathered.split(sizes, dim=dim), partition_rows):
            offset = 0
            for a, b in ranges:
                full.narrow(dim, a, b - a).copy_(piece.narrow(dim, offset, b - a))
                offset += b - a
        return full
    gathered = comm.all_gather(tensor.detach().contiguous(), group, dim=partition_dim)
    per_rank = [shard.chunk(stride, dim=partition_dim) for shard in gathered.chunk(n, dim=partition_dim)]
    return torch.cat([per_rank[r][block] for block in range(stride) for r in range(n)], dim=partition_dim)


def shard_full_tensor(full: torch.Tensor, *, partition_dim: int, stride: int = 1,
                      tp_group=None, partition_rows=None) -> torch.Tensor:
    """This rank's shard of ``full`` (no communication); ``partition_rows`` as for
    :func:`gather_full_tensor`."""
    group = resolve_tp_group(tp_group)
    n, rank = comm.group_size(group), comm.group_rank(group)
    if partition_rows is not None:
        return torch.cat([full.narrow(partition_dim, a, b - a) for a, b in partition_rows[rank]], dim=partition_dim)
    comm.check_divisible(full.shape[partition_dim], n * stride,
                         f"partition dimension {partition_dim} of shape {list(full.shape)} over stride {stride}")
    pieces = full.chunk(n * stride, dim=partition_dim)
    return torch.cat([pieces[block * n + rank] for block in range(stride)], dim=partition_dim)


def full_state_dict(module: nn.Module, *, tp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full shape (one all-gather per sharded parameter)."""
    return {layout.name: gather_full_tensor(layout.param, partition_dim=layout.partition_dim,
                                            stride=layout.partition_stride, tp_group=tp_group,
                                            partition_rows=layout.partition_rows)
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
            full = shard_full_tensor(full, partition_dim=layout.partition_dim, stride=layout.partition_stride,
                                     tp_group=tp_group, partition_rows=layout.partition_rows)
        layout.param.copy_(full)
