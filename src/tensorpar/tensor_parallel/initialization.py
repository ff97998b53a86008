"""TP-invariant weight initialisation and the parameter attributes that describe sharding.

The full (TP=1) weight is defined slab by slab: the partition dimension is cut into slabs of
a fixed number of rows (independent of TP), and slab ``k`` is filled by ``init_method`` under
a generator seeded from one draw of the default stream and ``k``. A rank builds only the slabs
that overlap its shard, so with the same ``torch.manual_seed`` the shards of every TP size
concatenate to exactly the TP=1 weight, while peak memory stays at one shard plus one slab
(Megatron gets the same invariance only by materialising the whole master weight on every
rank).

``init_method`` is called on each slab, so it must be element-wise (its distribution must not
depend on the tensor's shape), as :func:`init_method_normal` is.

Example::

    w = torch.empty(out // tp_size, in_)
    init_weight_shard(w, init_method_normal(0.02), partition_dim=0, stride=1, tp_group=group)
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from ..distributed import comm
from ..parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

InitMethod = Callable[[torch.Tensor], object]

SLAB_ELEMENTS = 1 << 22
_SEED_MIX = 0x9E3779B97F4A7C15
_TP_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}
# Megatron's optimizers tag parameters with these too (expert-TP, fused QKV split for Muon); a
# copy of a parameter keeps them, as a copy in megatron-core 0.19 does.
_OPTIMIZER_TAGS = ("expert_tp", "is_qkv", "qkv_split_shapes")


def init_method_normal(std: float) -> InitMethod:
    """``N(0, std)`` initialisation."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """``N(0, std / sqrt(2 * num_layers))``, for the projections feeding the residual stream."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int = 1) -> None:
    """Mark how ``tensor`` is sharded over TP (read by grads, checkpoints and the comm model)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the "not sharded" TP attributes it lacks."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    """Give ``destination_tensor`` the TP attributes and optimizer tags ``source_tensor`` has."""
    for name in (*_TP_ATTRIBUTE_DEFAULTS, *_OPTIMIZER_TAGS):
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_group=None, expert_tp_group=None) -> bool:
    """True for a TP shard, and for a replicated parameter on TP rank 0 only.

    Use it to count each parameter once, e.g. in a gradient norm summed over TP. A parameter
    marked ``allreduce = False`` (an expert's, reduced over expert-DP) is replicated over
    ``expert_tp_group`` when one is given, so its rank there decides.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not getattr(param, "allreduce", True) and expert_tp_group is not None:
        tp_group = expert_tp_group
    if tp_group is not None:
        return tp_group.rank() == 0
    return not model_parallel_is_initialized() or get_tensor_model_parallel_rank() == 0


def shard_rows(full_rows: int, tp_size: int, tp_rank: int, stride: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges of the full partition dimension that a rank holds, in order.

    With ``stride`` k the dimension is k equal blocks (Q|K|V, gate|up), each split across TP.
    """
    chunk = full_rows // (tp_size * stride)
    return [((block * tp_size + tp_rank) * chunk, (block * tp_size + tp_rank + 1) * chunk)
            for block in range(stride)]


def balanced_sizes(total: int, parts: int, granularity: int = 1) -> list[int]:
    """``total`` split into ``parts`` contiguous sizes, multiples of ``granularity``, as even as
    possible with the larger ones first: ``balanced_sizes(6, 4) == [2, 2, 1, 1]``."""
    units, extra = divmod(total // granularity, parts)
    return [(units + (i < extra)) * granularity for i in range(parts)]


def partition_ranges(sizes, rank: int, stride: int = 1) -> list[tuple[int, int]]:
    """The ``[start, stop)`` rows a rank holds when each of ``stride`` equal blocks is split
    into the per-rank ``sizes``; :func:`shard_rows` for equal sizes."""
    block, start = sum(sizes), sum(sizes[:rank])
    return [(b * block + start, b * block + start + sizes[rank]) for b in range(stride)]


def slab_seed(base: int, slab: int) -> int:
    """The seed of slab (or block) ``slab`` under one ``base`` draw of the default stream."""
    return (base + slab * _SEED_MIX) % (1 << 63)


def _seed_stream(seed: int, device: torch.device) -> None:
    """Seed the default generator that draws for ``device``, and on CPU that one alone:
    ``torch.manual_seed`` also seeds every accelerator backend, and one not initialised queues
    the seed with a formatted stack each time (half of a small model's build time on CPU)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class PartSeeds:
    """One draw of the default stream seeding each part of a model (a block, the embedding) on
    its own, so a part's weights do not depend on the parts built before it: a pipeline stage
    that builds only its own blocks holds the whole model's weights.

    Example::

        parts = PartSeeds()
        blocks = [parts.build(1 + i, Block, config, parallel, i) for i in stage_layers]
    """

    def __init__(self) -> None:
        self.base = int(torch.randint(0, 1 << 62, (1,), device="cpu").item())

    def build(self, part: int, factory, *args, **kwargs):
        """``factory(*args, **kwargs)`` with the default CPU stream seeded for ``part`` (and restored)."""
        with torch.random.fork_rng(devices=[]):
            _seed_stream(slab_seed(self.base, part), torch.device("cpu"))
            return factory(*args, **kwargs)


@torch.no_grad()
def init_weight_shard(weight: torch.Tensor, init_method: InitMethod, *, partition_dim: int,
                      stride: int = 1, tp_group=None, rows=None, full_rows=None) -> None:
    """Fill ``weight`` (this rank's shard) with its part of the TP-invariant full weight.

    ``rows`` (with ``full_rows``, the full partition dimension) lists the ``[start, stop)``
    rows of the full weight this shard holds, in order, for shards other than the equal split.
    Draws exactly one number from the default generator, on every rank alike.
    """
    tp_size = 1 if tp_group is None else comm.group_size(tp_group)
    tp_rank = 0 if tp_group is None else comm.group_rank(tp_group)
    base = int(torch.randint(0, 1 << 62, (1,), device="cpu").item())
    shard = weight.movedim(partition_dim, 0)
    local_rows = shard.shape[0]
    if rows is None:
        full_rows = local_rows * tp_size
        comm.check_divisible(full_rows, tp_size * stride, f"partition size {full_rows} with stride {stride}")
        rows = shard_rows(full_rows, tp_size, tp_rank, stride)
    row_numel = max(1, shard[0].numel()) if local_rows else 1
    rows_per_slab = max(1, SLAB_ELEMENTS // row_numel)
    devices = [weight.device] if weight.device.type != "cpu" else []
    offset = 0
    for start, stop in rows:
        if stop == start:
            continue
        first_slab, last_slab = start // rows_per_slab, (stop - 1) // rows_per_slab
        for slab in range(first_slab, last_slab + 1):
            slab_start = slab * rows_per_slab
            slab_stop = min(slab_start + rows_per_slab, full_rows)
            values = shard.new_empty((slab_stop - slab_start,) + tuple(shard.shape[1:]))
            with torch.random.fork_rng(devices=devices, device_type=weight.device.type):
                _seed_stream(slab_seed(base, slab), weight.device)
                init_method(values)
            lo, hi = max(start, slab_start), min(stop, slab_stop)
            shard[offset:offset + hi - lo].copy_(values[lo - slab_start:hi - slab_start])
            offset += hi - lo


def partition_layout(name, split_name, split_size, stride, tp_size, partition_sizes, partition_rows):
    """Every rank's ``[start, stop)`` rows of the full partition dimension, or None for the
    equal split (today's layout and code path)."""
    if partition_rows is not None:
        if partition_sizes is not None:
            raise ValueError(f"{name}: pass partition_sizes or partition_rows, not both")
        rows = tuple(tuple((int(a), int(b)) for a, b in ranges) for ranges in partition_rows)
        held = [0] * split_size
        for ranges in rows:
            for a, b in ranges:
                if not 0 <= a <= b <= split_size:
                    raise ValueError(f"{name}: partition_rows range ({a}, {b}) is outside [0, {split_size}]")
                held[a:b] = [h + 1 for h in held[a:b]]
        if len(rows) != tp_size or 0 in held:
            raise ValueError(f"{name}: partition_rows must give each of the {tp_size} ranks its rows, covering "
                             f"all {split_size} rows of {split_name}")
        return rows
    if partition_sizes is None:
        if split_size % (tp_size * stride) == 0:
            return None
        if split_size % stride:
            raise ValueError(f"{name}: {split_name} {split_size} is not divisible by stride {stride}")
        partition_sizes = balanced_sizes(split_size // stride, tp_size)
    sizes = list(partition_sizes)
    if len(sizes) != tp_size or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in sizes) \
            or sum(sizes) * stride != split_size:
        raise ValueError(f"{name}: partition_sizes must be {tp_size} non-negative ints (one per rank) summing to "
                         f"{split_name} {split_size}" + (f" / stride {stride}" if stride > 1 else "") +
                         f", got {partition_sizes!r}")
    if len(set(sizes)) == 1:
        return None
    return tuple(tuple(partition_ranges(sizes, rank, stride)) for rank in range(tp_size))


def replica_rows(rows, rank: int):
    """For rows several ranks hold: (this rank's local indices of them, their index among the
    shared rows, how many are shared, local indices of those an earlier rank holds too)."""
    holders: dict[int, list[int]] = {}
    for r, ranges in enumerate(rows):
        for a, b in ranges:
            for row in range(a, b):
                holders.setdefault(row, []).append(r)
    shared = {row: i for i, row in enumerate(sorted(row for row, rs in holders.items() if len(rs) > 1))}
    local = [row for a, b in rows[rank] for row in range(a, b)]
    mine = [(i, shared[row]) for i, row in enumerate(local) if row in shared]
    duplicates = [i for i, row in enumerate(local) if holders[row][0] != rank]
    return (torch.tensor([i for i, _ in mine], dtype=torch.long), torch.tensor([j for _, j in mine], dtype=torch.long),
            len(shared), torch.tensor(duplicates, dtype=torch.long))
