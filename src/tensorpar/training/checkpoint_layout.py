"""Which saving rank stores which box of each tensor: a chunk of DCP's ``.metadata`` must sit in
the file of a rank that held that box, so chunks whose offsets were swapped (each still a valid
box, the tensor still tiled) are refused instead of loading permuted rows.

DCP names each rank's file ``__{rank}_{n}.distcp``; rank ``r`` of a (TP ``t``, CP ``c``, DP ``d``,
PP ``p``) save is TP rank ``r % t`` and DP rank ``r // (t c) % d`` (Megatron's order: TP, CP, DP,
then PP; CP ranks hold the same weights but FSDP shards); the ranks of every stage write their stages' entries,
any of them one that stages share. A chunk is the whole tensor (a replicated or gathered entry,
written by any rank), this TP rank's shard of the sharded dimension (split evenly), for an
expert weight this EP rank's experts (``r % e`` of ``world.ep`` e: EP folds over consecutive
ranks, experts whole on each), or that
shard's dim-0 piece for this rank of the DP x CP group FSDP shards over, ``r // t % (c d)`` (an
FSDP box: ceil(rows / (c d)) rows each; under HSDP, with ``world.dp_replicate`` R, the piece of
rank ``% (c d / R)`` of ``c d / R``).

Example::

    problem = layout_problem(metadata.state_dict_metadata, metadata.storage_data,
                             world=meta["world"], shard_dims=shard_dims(model))
"""

from __future__ import annotations

import re

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from .checkpoint_format import ADAM_MOMENTS

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_RNG_KEY = re.compile(r"^rng\.rank(\d+)\.")


def shard_dims(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    """The sharded axis and dimension of each stored entry of ``model`` and its Adam moments:
    ``("tp", d)`` (a weight of ``partition_stride`` k is stored viewed as ``[k, rows / k, ...]``:
    one dimension further), or ``("ep", 0)`` for an expert weight."""
    dims = {}
    for name, p in model.named_parameters():
        if getattr(p, "expert_parallel", False):
            sharded = ("ep", 0)
        elif getattr(p, "tensor_model_parallel", False):
            sharded = ("tp", p.partition_dim % p.dim() + (p.partition_stride != 1))
        else:
            continue
        for key in (f"model.{name}", *(f"optim.{name}.{m}" for m in ADAM_MOMENTS)):
            dims[key] = sharded
    return dims


def _boxes(size: list[int], sharded: tuple[str, int] | None, *, ranks: dict[str, tuple[int, int]],
           dp_rank: int, dp: int) -> list:
    """The (offsets, sizes) a rank may store of a tensor of ``size`` sharded as ``sharded`` over
    the axis whose (rank, size) ``ranks`` names."""
    offsets, sizes = [0] * len(size), list(size)
    boxes = [(list(offsets), list(sizes))]
    if sharded is not None and size[sharded[1]] % ranks[sharded[0]][1] == 0:
        (rank, parts), dim = ranks[sharded[0]], sharded[1]
        sizes[dim] = size[dim] // parts
        offsets[dim] = rank * sizes[dim]
        boxes.append((list(offsets), list(sizes)))
    if size:
        rows = -(-sizes[0] // dp)
        start = min(dp_rank * rows, sizes[0])
        offsets[0], sizes[0] = offsets[0] + start, min(rows, sizes[0] - start)
        boxes.append((offsets, sizes))
    return boxes


def layout_problem(entries: dict, storage: dict, *, world: dict, shard_dims: dict[str, tuple[str, int]]) -> str | None:
    """The first chunk stored in a rank's file that this rank did not hold, or None."""
    tp, cp, dp, pp, ep = world["tp"], world.get("cp", 1), world["dp"], world.get("pp", 1), world.get("ep", 1)
    shards = cp * dp // world.get("dp_replicate", 1)  # HSDP: a replica of DP x CP / R consecutive ranks
    named = f"TP {tp} x " + (f"CP {cp} x " if cp > 1 else "") + f"DP {dp}" + (f" x PP {pp}" if pp > 1 else "") \
        + (f", EP {ep}" if ep > 1 else "")
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        for chunk in entry.chunks:
            if not all(chunk.sizes):  # an empty FSDP piece holds no data
                continue
            info = storage[MetadataIndex(key, torch.Size(chunk.offsets))]
            rank = _RANK_FILE.match(info.relative_path)
            if rank is None or int(rank.group(1)) >= tp * cp * dp * pp:
                return f"stores a chunk of {key} in {info.relative_path}, which no rank of {named} writes"
            r, own = int(rank.group(1)), _RNG_KEY.match(key)
            if own is not None and int(own.group(1)) != r:
                return f"stores {key} in {info.relative_path}, the file of rank {r}"
            held = _boxes(list(entry.size), shard_dims.get(key), ranks={"tp": (r % tp, tp), "ep": (r % ep, ep)},
                          dp_rank=r // tp % (cp * dp) % shards, dp=shards)
            if (list(chunk.offsets), list(chunk.sizes)) not in held:
                return (f"stores the chunk of {key} at offsets {list(chunk.offsets)} in {info.relative_path}, "
                        f"which saving rank {r} ({named}) does not hold")
    return None
