"""Which saving rank stores which box of each tensor: a chunk of DCP's ``.metadata`` must sit in
the file of a rank that held that box, so chunks whose offsets were swapped (each still a valid
box, the tensor still tiled) are refused instead of loading permuted rows.

DCP names each rank's file ``__{rank}_{n}.distcp``; rank ``r`` of a (TP ``t``, CP ``c``, DP ``d``,
PP ``p``) save is TP rank ``r % t`` and DP rank ``r // (t c) % d`` (Megatron's order: TP, CP, DP,
then PP; CP ranks hold the same weights but FSDP shards); the ranks of every stage write their stages' entries,
any of them one that stages share. A chunk is the whole tensor (a replicated or gathered entry,
written by any rank), this TP rank's shard of the sharded dimension (split evenly), or that
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


def shard_dims(model: torch.nn.Module) -> dict[str, int]:
    """The TP-sharded dimension of each stored entry of ``model`` and its Adam moments (a weight of
    ``partition_stride`` k is stored viewed as ``[k, rows / k, ...]``: one dimension further)."""
    dims = {}
    for name, p in model.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            continue
        dim = p.partition_dim % p.dim() + (p.partition_stride != 1)
        for key in (f"model.{name}", *(f"optim.{name}.{m}" for m in ADAM_MOMENTS)):
            dims[key] = dim
    return dims


def _boxes(size: list[int], dim: int | None, *, tp_rank: int, tp: int, dp_rank: int, dp: int) -> list:
    """The (offsets, sizes) a rank may store of a tensor of ``size`` sharded on ``dim`` over TP."""
    offsets, sizes = [0] * len(size), list(size)
    boxes = [(list(offsets), list(sizes))]
    if dim is not None and size[dim] % tp == 0:
        sizes[dim] = size[dim] // tp
        offsets[dim] = tp_rank * sizes[dim]
        boxes.append((list(offsets), list(sizes)))
    if size:
        rows = -(-sizes[0] // dp)
        start = min(dp_rank * rows, sizes[0])
        offsets[0], sizes[0] = offsets[0] + start, min(rows, sizes[0] - start)
        boxes.append((offsets, sizes))
    return boxes


def layout_problem(entries: dict, storage: dict, *, world: dict, shard_dims: dict[str, int]) -> str | None:
    """The first chunk stored in a rank's file that this rank did not hold, or None."""
    tp, cp, dp, pp = world["tp"], world.get("cp", 1), world["dp"], world.get("pp", 1)
    shards = cp * dp // world.get("dp_replicate", 1)  # HSDP: a replica of DP x CP / R consecutive ranks
    named = f"TP {tp} x " + (f"CP {cp} x " if cp > 1 else "") + f"DP {dp}" + (f" x PP {pp}" if pp > 1 else "")
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
            held = _boxes(list(entry.size), shard_dims.get(key), tp_rank=r % tp, tp=tp,
                          dp_rank=r // tp % (cp * dp) % shards, dp=shards)
            if (list(chunk.offsets), list(chunk.sizes)) not in held:
                return (f"stores the chunk of {key} at offsets {list(chunk.offsets)} in {info.relative_path}, "
                        f"which saving rank {r} ({named}) does not hold")
    return None
