"""How a sequence is cut over the CP group: 2 x CP chunks, rank i holding chunks i and 2CP-1-i.

Under a causal mask the query of position t attends to t + 1 keys, so cutting the sequence in
CP equal runs would leave the last rank with most of the work. Pairing chunk ``i`` with chunk
``2CP-1-i`` gives every rank the same number of (query, key) pairs. A sequence of any length
is padded at its end to a multiple of 2 x CP: a padded position comes after every real one, so
under the causal mask no real token ever reads it, and its loss is ignored (label -100).

Example::

    chunks = SequenceChunks(seq_len=7, cp_size=2, cp_rank=1)   # padded to 8, chunks of 2
    chunks.positions()                                         # tensor([2, 3, 4, 5])
    local = chunks.shard(tokens, dim=1)                        # [b, 4] of [b, 7]
    full = chunks.gather(local_out, dim=0, cp_group=group)     # [7, b, h] of [4, b, h]
"""

from __future__ import annotations

import dataclasses

import torch

from ..distributed import comm
from ..tensor_parallel.mappings import gather_from_sequence_parallel_region


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that ``cp_rank`` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def natural_order(cp_size: int, chunk_len: int, device=None) -> torch.Tensor:
    """The index that puts every rank's tokens, concatenated in rank order, in sequence order.

    Example::

        natural_order(2, 1)     # tensor([0, 2, 3, 1]): ranks hold [c0, c3], [c1, c2]
    """
    where = [0] * (2 * cp_size)
    for rank in range(cp_size):
        for half, chunk in enumerate(chunk_ids(cp_size, rank)):
            where[chunk] = 2 * rank + half
    starts = torch.tensor(where, device=device) * chunk_len
    return (starts[:, None] + torch.arange(chunk_len, device=device)).flatten()


@dataclasses.dataclass(frozen=True)
class SequenceChunks:
    """One CP rank's share of a sequence of ``seq_len`` tokens (see the module docstring);
    ``multiple``: each chunk's length a multiple of it (of TP, for sequence parallelism)."""

    seq_len: int
    cp_size: int
    cp_rank: int
    multiple: int = 1

    def __post_init__(self) -> None:
        for name in ("seq_len", "cp_size", "multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SequenceChunks.{name} must be a positive int, got {value!r}")
        if isinstance(self.cp_rank, bool) or not isinstance(self.cp_rank, int) \
                or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"SequenceChunks.cp_rank must be in [0, {self.cp_size}), got {self.cp_rank!r}")

    @classmethod
    def of(cls, seq_len: int, *, cp_group, multiple: int = 1) -> "SequenceChunks":
        """This rank's chunks of a ``seq_len`` sequence over ``cp_group``."""
        return cls(seq_len, comm.group_size(cp_group), comm.group_rank(cp_group), multiple)

    @property
    def chunk_len(self) -> int:
        return -(-self.seq_len // (2 * self.cp_size * self.multiple)) * self.multiple

    @property
    def padded_len(self) -> int:
        return 2 * self.cp_size * self.chunk_len

    @property
    def local_len(self) -> int:
        """Tokens this rank holds (padding included): two chunks."""
        return 2 * self.chunk_len

    @property
    def padding(self) -> int:
        return self.padded_len - self.seq_len

    def chunks(self) -> tuple[int, int]:
        return chunk_ids(self.cp_size, self.cp_rank)

    def positions(self, device=None) -> torch.Tensor:
        """The sequence positions of this rank's tokens (padded ones are ``>= seq_len``)."""
        return torch.cat([torch.arange(c * self.chunk_len, (c + 1) * self.chunk_len, device=device)
                          for c in self.chunks()])

    def shard(self, tensor: torch.Tensor, *, dim: int, pad_value=0) -> torch.Tensor:
        """This rank's tokens of ``tensor`` (``seq_len`` along ``dim``), padded with ``pad_value``
        (-100 for labels). Differentiable: the gradient reaches this rank's positions only."""
        dim = dim % tensor.dim()
        if tensor.shape[dim] != self.seq_len:
            raise ValueError(f"shard: dimension {dim} of shape {list(tensor.shape)} is not the sequence "
                             f"length {self.seq_len}")
        if self.padding:
            shape = list(tensor.shape)
            shape[dim] = self.padding
            tensor = torch.cat([tensor, tensor.new_full(shape, pad_value)], dim=dim)
        return torch.cat([tensor.narrow(dim, c * self.chunk_len, self.chunk_len) for c in self.chunks()], dim=dim)

    def gather(self, tensor: torch.Tensor, *, dim: int, cp_group) -> torch.Tensor:
        """The whole sequence (padding cut) from every rank's ``tensor`` (``local_len`` along
        ``dim``), on every rank: one all-gather. Its backward keeps this rank's share of the
        gradient, as for a consumer that every CP rank runs alike (the same loss everywhere)."""
        dim = dim % tensor.dim()
        if tensor.shape[dim] != self.local_len:
            raise ValueError(f"gather: dimension {dim} of shape {list(tensor.shape)} is not this rank's "
                             f"{self.local_len} tokens")
        gathered = gather_from_sequence_parallel_region(tensor.movedim(dim, 0), False, group=cp_group)
        order = natural_order(self.cp_size, self.chunk_len, gathered.device)[: self.seq_len]
        return gathered.index_select(0, order).movedim(0, dim)

    def scatter(self, tensor: torch.Tensor, *, dim: int, cp_group) -> torch.Tensor:
        """:meth:`shard` of a whole-sequence ``tensor`` every CP rank computed alike, whose backward
        all-gathers the gradient (:meth:`gather`): what computed ``tensor`` gets the whole
        sequence's gradient on every rank, as at CP = 1 (sequence parallelism's scatter, over CP)."""
        return _Scatter.apply(tensor, self, dim, cp_group)


class _Scatter(torch.autograd.Function):
    """Forward :meth:`SequenceChunks.shard`, backward :meth:`SequenceChunks.gather`."""

    @staticmethod
    def forward(ctx, tensor, chunks, dim, cp_group):
        ctx.chunks, ctx.dim, ctx.cp_group = chunks, dim, cp_group
        return chunks.shard(tensor, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.chunks.gather(grad.contiguous(), dim=ctx.dim, cp_group=ctx.cp_group), None, None, None
