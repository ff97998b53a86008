"""Megatron's small tensor-parallel helpers: splitting, 1-D shards, vocab ranges, broadcasting a
batch; and the grouping of consecutive modules by size that FSDP's units use.

All work on any device, over the TP group of ``initialize_model_parallel`` or an explicit
``tp_group``.

Example::

    first, second = tp.split_tensor_along_last_dim(torch.ones(3, 4), 2)   # two [3, 2] views
    batch = tp.broadcast_data(["tokens"], data, torch.int64)   # TP rank 0's data on every TP rank
"""

from __future__ import annotations

import torch

from . import comm
from .parallel_state import default_device, resolve_tp_group

__all__ = ["split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
           "VocabUtility", "broadcast_data"]

# broadcast_data sends every shape padded to this many dimensions (as Megatron does).
_MAX_DIMS = 8


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """``num_partitions`` equal views of ``tensor`` along its last dimension (copies if
    ``contiguous_split_chunks``)."""
    comm.check_divisible(tensor.shape[-1], num_partitions, "last dimension")
    chunks = torch.split(tensor, tensor.shape[-1] // num_partitions, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False, *,
                                      tp_group=None) -> torch.Tensor:
    """This TP rank's contiguous 1/TP of ``tensor`` flattened (a view, or a copy with ``new_buffer``).

    Example::

        tp.split_tensor_into_1d_equal_chunks(torch.arange(8.))   # TP=2, rank 1: tensor([4., 5., 6., 7.])
    """
    group = resolve_tp_group(tp_group)
    parts = comm.group_size(group)
    comm.check_divisible(tensor.numel(), parts, "element count")
    size = tensor.numel() // parts
    start = size * comm.group_rank(group)
    chunk = tensor.reshape(-1)[start:start + size]
    return chunk.clone() if new_buffer else chunk


def gather_split_1d_tensor(tensor: torch.Tensor, *, tp_group=None) -> torch.Tensor:
    """The TP ranks' 1-D ``tensor`` shards concatenated in rank order (the inverse of
    :func:`split_tensor_into_1d_equal_chunks`)."""
    return comm.all_gather(tensor.reshape(-1), resolve_tp_group(tp_group))


class VocabUtility:
    """The ``[first, last)`` vocabulary range a rank holds when the vocabulary is split evenly."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int, world_size: int):
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int):
        comm.check_divisible(global_vocab_size, world_size, "vocabulary size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(global_vocab_size // world_size, rank,
                                                                      world_size)


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


def consecutive_groups(sizes: list[int], *, at_least: int) -> tuple[list[list[int]], list[int]]:
    """Split the indices of ``sizes`` into runs in order, each closed once its sizes sum to
    ``at_least``; returns the runs and the trailing indices whose sizes sum to less.

    Example: ``consecutive_groups([3, 3, 3, 3, 3], at_least=5)`` is ``([[0, 1], [2, 3]], [4])``.
    """
    groups, run, total = [], [], 0
    for index, size in enumerate(sizes):
        run.append(index)
        total += size
        if total >= at_least:
            groups.append(run)
            run, total = [], 0
    return groups, run
