"""Megatron's ``broadcast_data``: TP rank 0's batch on every rank of its TP group.

Example::

    batch = tp.broadcast_data(["tokens"], data, torch.int64)   # TP rank 0's data on every TP rank
"""

from __future__ import annotations

import torch

from ..distributed import comm
from ..parallel_state import default_device, resolve_tp_group

__all__ = ["broadcast_data"]

# Every shape travels padded to this many dimensions (as Megatron's does).
_MAX_DIMS = 8


def broadcast_data(keys, data, datatype: torch.dtype, *, tp_group=None) -> dict[str, torch.Tensor]:
    """TP rank 0's ``data[key]`` for each key, on every rank of its TP group (on the backend's device).

    Only TP rank 0 reads ``data`` (the others may pass ``None``); every tensor there must have
    ``datatype``. Shapes travel first, then one flat buffer of all the values.

    Example::

        batch = tp.broadcast_data(["tokens", "labels"], data if tp_rank == 0 else None, torch.int64)
    """
    group = resolve_tp_group(tp_group)
    device = default_device()
    src = comm.group_rank(group) == 0
    keys = list(keys)
    shapes = torch.zeros(len(keys), _MAX_DIMS, dtype=torch.int64)
    if src:
        wrong = {k: data[k].dtype for k in keys if data[k].dtype != datatype}
        if wrong:
            raise TypeError(f"broadcast_data: {wrong} do not have datatype {datatype}")
        for i, key in enumerate(keys):
            if data[key].dim() > _MAX_DIMS or 0 in data[key].shape:
                raise ValueError(f"broadcast_data: {key!r} has shape {tuple(data[key].shape)}: at most "
                                 f"{_MAX_DIMS} dimensions, none of size 0")
            shapes[i, :data[key].dim()] = torch.tensor(data[key].shape)
    first = torch.distributed.get_global_rank(group, 0)
    shapes = comm.broadcast(shapes.to(device), first, group).cpu()
    sizes = [[int(d) for d in row if d > 0] for row in shapes]
    numels = [torch.Size(s).numel() for s in sizes]
    if src:
        flat = torch.cat([data[k].reshape(-1).to(device) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    flat = comm.broadcast(flat, first, group)
    return {key: part.view(size) for key, part, size in zip(keys, torch.split(flat, numels), sizes)}
