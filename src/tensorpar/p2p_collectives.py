"""All-gather of a flat tensor as a ring of point-to-point exchanges, for gloo.

gloo's own ``all_gather_into_tensor`` is slower on CPU than a ring of ``n - 1`` exchanges, each
rank sending one ``1/n`` chunk to its right neighbour while receiving one from its left, and it
allocates what the ring does not (8 MiB fp32 over groups of 2 and of 4, 4 ranks on a 2-core
machine: 18 ms / 25 ms against 11 ms / 16 ms as a ring). FSDP's all-gathers run through it on gloo
(``fsdp.fully_shard``): a GPT step's peak allocation fell from 33 to 18 MiB per rank at TP 2 x DP 2
(``benchmarks/fsdp_memory.py``). NCCL's own all-gather already is a ring.

(gloo's reduce-scatter is slower than a ring too, 27 ms / 53 ms against 19 ms / 34 ms at the same
sizes, but FSDP's step peaked 20 MiB higher with a ring in its place, unexplained: it stays gloo's.)

Example::

    flat = torch.empty(shard.numel() * comm.group_size(dp_group))
    ring_all_gather(flat, shard, dp_group)           # flat = every rank's shard, in rank order
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm

__all__ = ["ring_all_gather", "uses_ring"]


def uses_ring(group: dist.ProcessGroup) -> bool:
    """Whether FSDP's all-gathers over ``group`` run as :func:`ring_all_gather`: on gloo, over 2 ranks or more."""
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
