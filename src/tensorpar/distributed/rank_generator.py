"""Which global ranks form each parallel group: Megatron's rank layout, as plain lists.

Every rank is a point of a grid whose axes are the parallel dimensions, listed in ``order``
with the first axis varying fastest: with ``order="tp-cp-ep-dp-pp"`` consecutive ranks share
everything but their TP rank. A group over some axes (``"tp-dp"``) is the set of ranks that
agree on all the other axes; groups are listed by the other axes' coordinates (first axis
fastest) and each group's members by its own axes' coordinates.

Example::

    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    gen.get_ranks("tp")   # [[0, 1], [2, 3], [4, 5], [6, 7]]
    gen.get_ranks("pp")   # [[0, 4], [1, 5], [2, 6], [3, 7]]
"""

from __future__ import annotations

import math

from ..errors import UsageError

AXES = ("tp", "pp", "dp", "ep", "cp")


class ParallelLayoutError(UsageError, RuntimeError):
    """Sizes or an order that cannot lay out the world (Megatron raises RuntimeError here)."""


def _digits(index: int, sizes) -> list[int]:
    """``index`` in the mixed radix ``sizes``, least significant (first) digit first."""
    digits = []
    for size in sizes:
        digits.append(index % size)
        index //= size
    return digits


def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size, mask) -> list[list[int]]:
    """The groups spanning the axes where ``mask`` is True, of a grid of ``parallel_size``.

    Example::

        generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [True, False, True])
        # [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    if math.prod(parallel_size) != world_size:
        raise ParallelLayoutError(f"the parallel sizes {list(parallel_size)} multiply to "
                                  f"{math.prod(parallel_size)}, not the world size {world_size}")
    strides, stride = [], 1
    for size in parallel_size:
        strides.append(stride)
        stride *= size
    inner = [(s, d) for s, d, m in zip(parallel_size, strides, mask) if m]
    outer = [(s, d) for s, d, m in zip(parallel_size, strides, mask) if not m]

    def offset(index, axes):
        return sum(c * d for c, (_, d) in zip(_digits(index, [s for s, _ in axes]), axes))

    group_size = math.prod(s for s, _ in inner)
    return [[offset(g, outer) + offset(i, inner) for i in range(group_size)]
            for g in range(world_size // group_size)]


class RankGenerator:
    """Megatron's rank lists for sizes ``tp, ep, dp, pp, cp`` laid out in ``order``.

    An axis missing from ``order`` must have size 1 (it is appended). ``get_ranks("tp-dp")``
    lists every TP x DP group, each shifted by ``rank_offset``.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0) -> None:
        if ep != 1 and cp != 1:
            raise ParallelLayoutError(f"RankGenerator: ep={ep} and cp={cp} are both above 1; one generator "
                                      "lays out either context parallelism or expert parallelism")
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        tokens = order.lower().split("-")
        unknown = [t for t in tokens if t not in AXES]
        if unknown or len(set(tokens)) != len(tokens):
            raise ParallelLayoutError(f"order {order!r}: each of {'/'.join(AXES)} at most once, "
                                      f"joined by '-' (bad: {unknown or 'a repeated axis'})")
        for name, size in self.name_to_size.items():
            if name not in tokens:
                if size != 1:
                    raise ParallelLayoutError(f"the {name} size is {size} but order {order!r} does not name {name}")
                tokens.append(name)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> list[bool]:
        """True at each axis of ``order`` that ``token`` (``"tp-dp"``) names."""
        axes = order.split("-")
        wanted = token.split("-")
        missing = [t for t in wanted if t not in axes]
        if missing:
            raise ParallelLayoutError(f"token {token!r} names {missing}, not in order {order!r}")
        return [axis in wanted for axis in axes]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group over the axes of ``token``, as lists of global ranks."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[r + self.rank_offset for r in group] for group in groups]


def default_embedding_ranks(pp_ranks) -> list[int]:
    """The stages holding the word embedding: the first and the last of a pipeline."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks) -> list[int]:
    """The stage holding the position embedding: the pipeline's first."""
    return [pp_ranks[0]]


def hierarchical_rank_groups(ranks, sizes) -> list[list[list[int]]]:
    """Per level, the sub-groups of ``ranks`` split hierarchically by ``sizes`` (innermost first).

    Level ``k`` groups ranks ``sizes[k]`` at a time, ``prod(sizes[:k])`` apart.

    Example::

        hierarchical_rank_groups(list(range(8)), [2, 4])
        # [[[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]]
    """
    if math.prod(sizes) != len(ranks):
        raise ParallelLayoutError(f"hierarchical sizes {list(sizes)} multiply to {math.prod(sizes)}, "
                                  f"not the {len(ranks)} ranks they split")
    levels = []
    for level, size in enumerate(sizes):
        below, above = math.prod(sizes[:level]), math.prod(sizes[level + 1:])
        levels.append([[ranks[outer * size * below + i * below + inner] for i in range(size)]
                       for outer in range(above) for inner in range(below)])
    return levels
