"""The invariant mode's tied embedding under FSDP and PP: the first stage's embedding and the
last stage's LM head are two copies of one weight, whose gradient at PP=1 is, per micro-batch,
the sum of the two uses (one add, autograd's) before the micro-batch tree.

FSDP reduces each copy on its own stage. Here the copy's unsharded gradient is taken out of
FSDP after each backward (:func:`tensorpar.data_parallel.fsdp.take_unsharded_grad`, before the stage's
reduction, which then passes it by) and kept per micro-batch; :meth:`ShardedTiedGrads.finish`
gathers both copies' over the embedding group, adds them per micro-batch, sums the micro-batches
in the tree of :class:`~tensorpar.data_parallel.fsdp.ShardedGradSync` (:class:`~tensorpar.distributed.tree_reduce.HalvingTree`,
then :func:`~tensorpar.distributed.tree_reduce.reduce_scatter_tree` over the shard group, CP rank 0's
alone under CP) and sets each copy's sharded gradient: both copies get the same bits, those of
PP=1's weight.

Example::

    tied = ShardedTiedGrads([stage.embedding.word.weight], microbatches=4, embedding_group=group)
    tied.take(stage, micro_batch=k)     # after each backward, before FSDP's reduction
    tied.finish()                       # after the schedule
"""

from __future__ import annotations

import torch

from ..distributed import comm
from ..data_parallel.fsdp import shard_group, take_unsharded_grad
from ..distributed.tree_reduce import HalvingTree, reduce_scatter_tree


class ShardedTiedGrads:
    """This rank's FSDP-sharded copies ``params`` of a tied embedding (see above)."""

    def __init__(self, params, *, microbatches: int, embedding_group, cp_group=None) -> None:
        self.params, self.microbatches, self.embedding_group = list(params), microbatches, embedding_group
        self.enters_tree = cp_group is None or comm.group_rank(cp_group) == 0
        self.kept: dict[int, dict[int, torch.Tensor]] = {id(p): {} for p in self.params}

    def take(self, stage: torch.nn.Module, *, micro_batch: int) -> None:
        """Keep micro-batch ``micro_batch``'s gradient of the copies in ``stage`` (an FSDP root)."""
        for param in self.params:
            if (grad := take_unsharded_grad(stage, param)) is not None:
                self.kept[id(param)][micro_batch] = grad

    @torch.no_grad()
    def finish(self) -> None:
        """Set each copy's sharded gradient; every micro-batch's must have been taken."""
        m = self.microbatches
        for param in self.params:
            kept = self.kept[id(param)]
            if sorted(kept) != list(range(m)):
                raise RuntimeError(f"pipeline invariant mode under FSDP: the tied embedding had the gradients of "
                                   f"micro-batches {sorted(kept)}, not 0..{m - 1}")
            both = comm.all_gather(torch.stack([kept[k] for k in range(m)]), self.embedding_group)  # first, last
            tree = HalvingTree(leaves=m)
            for k in range(m):
                total = tree.add(both[k] + both[m + k])
            if not self.enters_tree:  # as ShardedGradSync's trees: x + -0.0 is x
                total.fill_(-0.0)
            group = shard_group(param)
            rows, n = total.shape[0], comm.group_size(group)
            padded = total.new_zeros(-(-rows // n) * n, *total.shape[1:])  # FSDP's dim-0 split
            padded[:rows] = total
            local = torch.zeros_like(param)
            local.to_local().add_(reduce_scatter_tree(padded, group, dim=0)[:local.to_local().shape[0]])
            param.grad = local
            kept.clear()
