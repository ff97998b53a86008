"""Megatron's small tensor-parallel helpers: splitting, 1-D shards, vocab ranges.

All work on any device, over the TP group of ``initialize_model_parallel`` or an explicit
``tp_group``.

Example::

    first, second = tp.split_tensor_along_last_dim(torch.ones(3, 4), 2)   # two [3, 2] views
"""

from __future__ import annotations

import torch

from ..distributed import comm
from ..parallel_state import resolve_tp_group

__all__ = ["split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
           "VocabUtility"]


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
