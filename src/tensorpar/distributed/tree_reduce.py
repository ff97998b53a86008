"""Sums over TP ranks in a fixed order: a pairwise tree over ``BLOCKS`` fixed blocks.

What the TP-invariant mode (:mod:`tensorpar.invariant`) and the gradient helpers of
:mod:`tensorpar.data_parallel.grads` sum with, so that a sum's order does not depend on the TP size: a rank's
tree over its own blocks is a subtree of TP = 1's, and the cross-rank step finishes the same tree.

Example::

    total = all_reduce_tree(partial, tp_group)     # the same bits at TP = 1, 2, 4, 8
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import comm

# Fixed blocks per TP-split dimension: TP = 1, 2, 4 and 8 own whole blocks.
BLOCKS = 8


def tree_sum(parts) -> torch.Tensor:
    """The sum of ``parts`` in one fixed tree: a chain (``(p0 + p1) + p2``) over each run of the
    count's odd part, then pairwise over the runs' sums; over a power-of-two count,
    ``((p0 + p1) + (p2 + p3)) + ...``. The tree of :class:`HalvingTree`; :func:`subtrees` names
    its nodes.

    Adds in place into the parts (temporaries of the caller): the same bits as new tensors,
    without allocating one per add.
    """
    parts = list(parts)
    run = _odd_part(len(parts))
    chains = []
    for start in range(0, len(parts), run):
        chain = parts[start]
        for part in parts[start + 1:start + run]:
            chain = chain.add_(part)
        chains.append(chain)
    while len(chains) > 1:
        chains = [chains[i].add_(chains[i + 1]) for i in range(0, len(chains), 2)]
    return chains[0]


def _odd_part(n: int) -> int:
    return n // (n & -n)


def subtrees(first: int, count: int, leaves: int) -> list[tuple[int, int]]:
    """The fewest nodes of :func:`tree_sum`'s tree over ``leaves`` parts that cover parts
    ``[first, first + count)``, in order, each as ``(its first part, its number of parts)``.

    A rank holding those parts sums each node (:func:`subtree_sums`); the ranks' node sums then
    finish the whole tree (:func:`reduce_scatter_subtrees`). One node where the parts are a
    subtree: the ranges of TP 2, 4 and 8 over 8 or 24 leaves; TP 3 over 24 leaves has up to four.

    Example::

        subtrees(8, 8, 24)     # [(8, 1), (9, 3), (12, 3), (15, 1)]: a chain's end, two chains, a start
    """
    run, nodes, at, stop = _odd_part(leaves), [], first, first + count
    while at < stop:
        size = 1
        if at % run == 0:  # a chain's start: its prefixes are nodes, whole chains pair upwards
            size = min(run, stop - at)
            while size >= run and at % (2 * size) == 0 and at + 2 * size <= stop:
                size *= 2
        nodes.append((at, size))
        at += size
    return nodes


def _node_sum(first: int, size: int, run: int, known) -> torch.Tensor:
    """Node ``(first, size)`` of the tree (chains of ``run``), from ``known(first, size)``: a
    node's sum, or None for one to add up from its children (in place into the left one)."""
    value = known(first, size)
    if value is not None:
        return value
    if size > run:  # two whole halves
        half = size // 2
        return _node_sum(first, half, run, known).add_(_node_sum(first + half, half, run, known))
    if size == 1:
        raise ValueError(f"tree_reduce: part {first} is missing")
    return _node_sum(first, size - 1, run, known).add_(_node_sum(first + size - 1, 1, run, known))


def subtree_sums(parts, *, first: int, leaves: int) -> list[torch.Tensor]:
    """This rank's ``parts`` (parts ``first, first + 1, ...`` of ``leaves``), summed as the nodes
    of :func:`subtrees`: a rank's share of :func:`tree_sum` over all of them. Adds in place
    into the parts."""
    parts = list(parts)
    run = _odd_part(leaves)

    def known(at, size):
        return parts[at - first] if size == 1 else None

    return [_node_sum(at, size, run, known) for at, size in subtrees(first, len(parts), leaves)]


def _rank_subtrees(n: int, leaves: int) -> list[list[tuple[int, int]]]:
    """Each of ``n`` ranks' nodes: rank ``r`` holds the ``r``-th of ``n`` equal runs of the leaves."""
    comm.check_divisible(leaves, n, "the fixed blocks")
    return [subtrees(r * leaves // n, leaves // n, leaves) for r in range(n)]


def reduce_scatter_subtrees(sums: list[torch.Tensor], group, *, leaves: int, dim: int = 0, async_op: bool = False):
    """:func:`tree_sum` over all ``leaves`` parts, of which each rank of ``group`` summed its
    equal run as :func:`subtree_sums` (``sums``), keeping this rank's slice along ``dim``.

    Where each rank's run is one node: :func:`reduce_scatter_tree`. Otherwise (TP 3 over 24
    blocks) an all-to-all of every node's slice (as many times the bytes as the most nodes a
    rank has), and the whole tree over the nodes received.
    """
    nodes = _rank_subtrees(comm.group_size(group), leaves)
    if all(len(mine) == 1 for mine in nodes):
        return reduce_scatter_tree(sums[0], group, dim=dim, async_op=async_op)
    n, width = len(nodes), max(len(mine) for mine in nodes)
    comm.check_divisible(sums[0].shape[dim], n, f"dimension {dim} of shape {list(sums[0].shape)}")
    stacked = torch.stack(sums + [torch.zeros_like(sums[0])] * (width - len(sums))).movedim(dim + 1, 1)
    slices = stacked.reshape(width, n, -1, *stacked.shape[2:]).transpose(0, 1)
    received = comm.all_to_all(slices, group)  # [source rank, its nodes, this rank's slice...]
    given = {node: received[source, k] for source, mine in enumerate(nodes) for k, node in enumerate(mine)}
    total = _node_sum(0, leaves, _odd_part(leaves), lambda at, size: given.get((at, size)))
    return _finished(total.movedim(0, dim), async_op)


def all_reduce_subtrees(sums: list[torch.Tensor], group, *, leaves: int, async_op: bool = False):
    """:func:`reduce_scatter_subtrees` of the flat sums, then an all-gather: the whole sum on
    every rank (where each rank's run is one node: :func:`all_reduce_tree`)."""
    nodes = _rank_subtrees(comm.group_size(group), leaves)
    if all(len(mine) == 1 for mine in nodes):
        return all_reduce_tree(sums[0], group, async_op=async_op)
    shape, n = sums[0].shape, len(nodes)
    flat = [F.pad(s.reshape(-1), (0, -s.numel() % n)) for s in sums]
    total = comm.all_gather(reduce_scatter_subtrees(flat, group, leaves=leaves), group)
    return _finished(total[:shape.numel()].view(shape), async_op)


def balanced_order(n: int) -> list[int]:
    """``[0, n-1, 1, n-2, ...]``: the order in which the invariant mode adds a sequence's row blocks.

    Context parallelism gives CP rank ``i`` chunks ``i`` and ``2CP-1-i`` of ``2 x CP``; in this
    order the blocks of each CP rank (at CP = 1, 2, 4 of ``BLOCKS``) are one aligned run, so
    their :func:`tree_sum` is a subtree of CP = 1's and the CP ranks' sums, added pairwise in
    rank order, finish the same tree.

    Example::

        balanced_order(4)     # [0, 3, 1, 2]: blocks 0 and 3 (CP rank 0's at CP 2) first
    """
    return [i // 2 if i % 2 == 0 else n - 1 - i // 2 for i in range(n)]


def sequence_sum(blocks) -> torch.Tensor:
    """The :func:`tree_sum` of this rank's row blocks of a sequence (in its order: chunk ``i``'s,
    then chunk ``2CP-1-i``'s) taken in :func:`balanced_order`: a subtree of the CP = 1 tree,
    which :func:`all_reduce_tree` over the CP group finishes. Adds in place into the blocks."""
    blocks = list(blocks)
    return tree_sum(blocks[i] for i in balanced_order(len(blocks)))


def _one_add(tensor: torch.Tensor, n: int) -> bool:
    """Whether the backend's own reduction of ``tensor`` over ``n`` ranks is the tree's: two
    operands are one IEEE add, correctly rounded in either order, in fp32 and fp64 (in 16-bit
    types a backend may round once or through fp32)."""
    return n == 2 and tensor.dtype in (torch.float32, torch.float64)


def _finished(result: torch.Tensor, async_op: bool):
    return comm.Handle(None, result) if async_op else result


def reduce_scatter_tree(partial: torch.Tensor, group, *, dim: int = 0, async_op: bool = False):
    """Sum ``partial`` over ``group`` in rank order (a pairwise tree), keeping this rank's slice along ``dim``.

    An all-to-all of the slices, then :func:`tree_sum` of the ``TP`` slices received; over two
    ranks in fp32/fp64, the backend's reduce-scatter (the same single add). ``async_op=True``
    returns a :class:`~tensorpar.distributed.comm.Handle`: in flight where it is the backend's reduce-scatter,
    else already finished.
    """
    n = comm.group_size(group)
    if n == 1:
        return _finished(partial, async_op)
    if _one_add(partial, n):
        return comm.reduce_scatter(partial, group, dim=dim, async_op=async_op)
    comm.check_divisible(partial.shape[dim], n, f"dimension {dim} of shape {list(partial.shape)}")
    slices = partial.movedim(dim, 0)
    slices = slices.reshape(n, slices.shape[0] // n, *slices.shape[1:])
    received = comm.all_to_all(slices, group)
    total = tree_sum(received.unbind(0)).movedim(0, dim)
    return _finished(total, async_op)


def all_reduce_tree(tensor: torch.Tensor, group, *, async_op: bool = False):
    """Sum ``tensor`` over ``group`` in rank order: :func:`reduce_scatter_tree` of the flat
    tensor, then an all-gather (the bytes of a ring all-reduce); over two ranks in fp32/fp64,
    the backend's all-reduce, in place (``tensor`` is the caller's temporary). ``async_op``: as
    :func:`reduce_scatter_tree`'s (in flight over two ranks)."""
    n = comm.group_size(group)
    if n == 1:
        return _finished(tensor, async_op)
    if _one_add(tensor, n):
        return comm.all_reduce(tensor, group, async_op=async_op)
    flat = tensor.reshape(-1)
    if flat.numel() % n:
        flat = F.pad(flat, (0, -flat.numel() % n))
    total = comm.all_gather(reduce_scatter_tree(flat, group), group)[:tensor.numel()].view(tensor.shape)
    return _finished(total, async_op)


class HalvingTree:
    """A streaming sum of ``leaves`` parts, fed in order, in one fixed tree: halves while the
    count is even, then a chain (``((p0 + p1) + p2)``) over each odd run of parts.

    The tree of any ``2**i`` consecutive equal pieces of it is a subtree: the sum of micro-batches
    ``[r A, (r + 1) A)`` on DP rank ``r`` (``A`` = ``leaves / 2**i``), finished over the DP ranks
    by :func:`all_reduce_tree` (pairwise in rank order), is the sum at DP = 1. Holds ``log2``
    partial sums; adds in place into the parts (temporaries of the caller).

    Example::

        tree = HalvingTree(leaves=4)
        for grad in grads: total = tree.add(grad)     # the sum once the 4th part is in, else None
    """

    def __init__(self, *, leaves: int) -> None:
        self.leaves, self.run = leaves, leaves // (leaves & -leaves)  # the odd part: the chains' length
        self.reset()

    def reset(self) -> None:
        self.count, self.chain, self.nodes = 0, None, []  # nodes: (parts summed, partial sum)

    def add(self, part: torch.Tensor) -> torch.Tensor | None:
        """Add the next part; the whole sum once the last part is in, else None."""
        if self.count == self.leaves:
            raise RuntimeError(f"HalvingTree: more than its {self.leaves} parts")
        self.chain = part if self.chain is None else self.chain.add_(part)
        self.count += 1
        if self.count % self.run:
            return None
        node, size, self.chain = self.chain, 1, None
        while self.nodes and self.nodes[-1][0] == size:
            node, size = self.nodes.pop()[1].add_(node), size * 2
        self.nodes.append((size, node))
        return node if self.count == self.leaves else None


class SourceTrees:
    """:class:`HalvingTree` ``(sources x leaves)`` fed ``sources`` parts at a time: part ``i`` of
    every source together, source ``s``'s parts being parts ``[s leaves, (s + 1) leaves)`` of the
    tree. Each source's parts are summed in a tree of their own (a subtree), the sources' sums
    then pairwise (``sources`` a power of two): an expert's gradient on a rank of an EP group over
    several DP ranks, whose every backward holds one micro-batch of each (in the invariant mode).

    Example::

        trees = SourceTrees(sources=2, leaves=4)
        for pair in grads: total = trees.add(pair)     # [micro-batch i of DP rank 0, of DP rank 1]
    """

    def __init__(self, *, sources: int, leaves: int) -> None:
        if sources & (sources - 1):
            raise ValueError(f"SourceTrees: {sources} sources are not a power of two")
        self.trees = [HalvingTree(leaves=leaves) for _ in range(sources)]
        self.leaves = leaves

    @property
    def count(self) -> int:
        return self.trees[0].count

    def reset(self) -> None:
        for tree in self.trees:
            tree.reset()

    def add(self, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """Add each source's next part; the whole sum once the last parts are in, else None."""
        if len(parts) != len(self.trees):
            raise ValueError(f"SourceTrees: {len(parts)} parts for {len(self.trees)} sources")
        totals = [tree.add(part) for tree, part in zip(self.trees, parts)]
        return None if totals[0] is None else tree_sum(totals)


def subtree_sizes(leaves: int) -> list[int]:
    """The numbers of ranks whose equal consecutive pieces of :class:`HalvingTree` ``(leaves)``
    (:func:`tree_sum`'s tree) are subtrees: the powers of two dividing ``leaves``."""
    return [1 << i for i in range((leaves & -leaves).bit_length())]
