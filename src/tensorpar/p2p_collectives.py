"""All-gather and reduce-scatter of flat tensors as rings of point-to-point exchanges, for gloo.

gloo's own ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are slower on CPU than a ring
of ``n - 1`` exchanges, each rank sending one ``1/n`` chunk to its right neighbour while receiving
one from its left, and allocate what the ring does not (8 MiB fp32 over groups of 2 and of 4, 4
ranks on a 2-core machine: all-gather 18 ms / 25 ms against 11 ms / 16 ms as a ring,
reduce-scatter 27 ms / 53 ms against 19 ms / 34 ms; gloo's reduce-scatter copies its input
twice). FSDP's collectives run on gloo through :func:`flat_all_gather` and
:func:`flat_reduce_scatter`: through the group's shared memory where it has one
(:mod:`tensorpar.shared_memory`), else as these rings. NCCL's own collectives already are rings.

Example::

    flat = torch.empty(shard.numel() * comm.group_size(dp_group))
    ring_all_gather(flat, shard, dp_group)           # flat = every rank's shard, in rank order
    ring_reduce_scatter(shard, flat, dp_group)       # shard = the sum of every rank's chunk `rank`
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm, shared_memory
from .gloo_transport import fold

__all__ = ["flat_all_gather", "flat_reduce_scatter", "ring_all_gather", "ring_reduce_scatter", "uses_ring"]


def uses_ring(group: dist.ProcessGroup) -> bool:
    """Whether FSDP's collectives over ``group`` run as rings: on gloo, over 2 ranks or more."""
    return dist.get_backend(group) == "gloo" and comm.group_size(group) > 1


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``output`` = every rank's ``input`` in group-rank order (flat, contiguous tensors)."""
    n, rank = comm.group_size(group), comm.group_rank(group)
    if output.dim() != 1 or input.dim() != 1 or not output.is_contiguous() or output.numel() != n * input.numel():
        raise ValueError(f"ring_all_gather: output {list(output.shape)} must be 1-D, contiguous and {n} times "
                         f"the input {list(input.shape)}")
    chunks = output.view(n, -1)
    chunks[rank].copy_(input)
    right, left = dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)
    for step in range(n - 1):
        # Not comm.send_recv: a ledger records the whole all-gather (FSDP's hook does), not its steps.
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[(rank - step) % n], right, group),
                                        dist.P2POp(dist.irecv, chunks[(rank - step - 1) % n], left, group)])
        for work in works:
            work.wait()
    return output


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``output`` = the sum over the group's ranks of chunk ``rank`` of their ``input`` (flat,
    contiguous tensors; ``input`` is summed into in place). Chunk ``c``'s sum starts at rank
    ``c + 1`` and goes round the ring to ``c``; over 2 ranks it is ``a + b``, as any all-reduce's."""
    n, rank = comm.group_size(group), comm.group_rank(group)
    if (output.dim() != 1 or input.dim() != 1 or not output.is_contiguous() or not input.is_contiguous()
            or input.numel() != n * output.numel()):
        raise ValueError(f"ring_reduce_scatter: input {list(input.shape)} and output {list(output.shape)} must be "
                         f"1-D and contiguous, the input {n} times the output")
    chunks = input.view(n, -1)
    if n == 1:
        return output.copy_(chunks[0])
    right, left = dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)
    received = output if n == 2 else torch.empty_like(output)
    for step in range(n - 1):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[(rank - step - 1) % n], right, group),
                                        dist.P2POp(dist.irecv, received, left, group)])
        for work in works:
            work.wait()
        if step < n - 2:
            chunks[(rank - step - 2) % n].add_(received)
    return torch.add(received, chunks[rank], out=output)


def flat_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`ring_all_gather`'s result, through ``group``'s shared memory where it has one."""
    shared = shared_memory.channel(group)
    if shared is None:
        return ring_all_gather(output, input, group)
    n, rank = comm.group_size(group), comm.group_rank(group)
    chunks = output.view(n, -1)
    chunks[rank].copy_(input)
    shared.start(input, [None if peer == rank else chunks[peer] for peer in range(n)]).wait()
    return output


def flat_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`ring_reduce_scatter`'s result, through ``group``'s shared memory where it has one:
    then the chunks are summed in rank order (over 2 ranks the same bits as the ring's)."""
    shared = shared_memory.channel(group)
    if shared is None:
        return ring_reduce_scatter(output, input, group)
    n, rank = comm.group_size(group), comm.group_rank(group)
    chunks = [input.view(n, -1)[rank] if peer == rank else torch.empty_like(output) for peer in range(n)]
    shared.start(input, [None if peer == rank else chunk for peer, chunk in enumerate(chunks)], block=rank).wait()
    return fold(chunks, "sum", out=output)
