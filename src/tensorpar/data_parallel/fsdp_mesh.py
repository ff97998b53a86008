"""The device meshes FSDP shards over: the DP group's (:func:`dp_mesh`), HSDP's 2-D replicate x
shard mesh (:func:`hsdp_mesh`), and a shard's place in them (:func:`shard_group`,
:func:`replica_group`); for checkpoints, the (TP, DP) mesh of a TP x FSDP rank and a shard as a
box of the TP=1 tensor on it (:func:`tp_dp_mesh`, :func:`full_box`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..distributed import comm
from ..distributed.parallel_registry import CREATED, GROUPS
from ..parallel_state import get_data_parallel_group

__all__ = ["dp_mesh", "hsdp_mesh", "shard_group", "replica_group", "tp_dp_mesh", "full_box"]


def _device_type(group: dist.ProcessGroup) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def dp_mesh(dp_group: dist.ProcessGroup) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over ``dp_group`` on the backend's device type."""
    return DeviceMesh.from_group(dp_group, _device_type(dp_group))


def _hsdp_groups(dp_ranks: list[int], replicate: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (replicate, shard) groups of its DP group (collective over the world: every
    rank creates every DP group's, in one order, the first time; kept until destroy_model_parallel)."""
    key = f"hsdp x{replicate} {dp_ranks}"
    if key not in GROUPS:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (replicate, dp_ranks))
        for r, ranks in sorted({(r, tuple(ranks)) for r, ranks in every}):
            grid = torch.tensor(ranks).reshape(r, -1)
            for kind, rows in (("replicate", grid.t()), ("shard", grid)):
                for row in rows.tolist():
                    group = dist.new_group(ranks=row)
                    if dist.get_rank() in row:
                        GROUPS[f"hsdp x{r} {list(ranks)} {kind}"] = group
                        CREATED.append(group)
        GROUPS[key] = GROUPS[f"{key} shard"]
    return GROUPS[f"{key} replicate"], GROUPS[f"{key} shard"]


def hsdp_mesh(dp_group: dist.ProcessGroup, replicate: int) -> DeviceMesh:
    """The 2-D (``dp_replicate``, ``dp_shard``) mesh of ``dp_group`` for HSDP (collective): its ranks
    as ``replicate`` rows of ``DP / replicate`` consecutive ranks; a shard group is a row, a
    replica group a column. ``replicate=1`` is the 1-D mesh :func:`dp_mesh`.

    Example: at DP 4, ``hsdp_mesh(dp_group, 2)`` shards over DP ranks {0, 1} and {2, 3} and
    replicates over {0, 2} and {1, 3}.
    """
    ranks, size = dist.get_process_group_ranks(dp_group), comm.group_size(dp_group)
    if replicate < 1 or size % replicate:
        raise ValueError(f"fully_shard: dp_replicate={replicate} does not divide the DP size {size}")
    if replicate == 1:
        return dp_mesh(dp_group)
    groups = _hsdp_groups(ranks, replicate)
    return DeviceMesh.from_group(list(groups), _device_type(dp_group), mesh=torch.tensor(ranks).reshape(replicate, -1),
                                 mesh_dim_names=("dp_replicate", "dp_shard"))


def shard_group(tensor: DTensor) -> dist.ProcessGroup:
    """The group an FSDP shard is split over: the DP group, or under CP the DP x CP group; under
    HSDP (``fully_shard(dp_replicate=R)``) this rank's row of it, the shard group.

    Example: ``shard_group(model.blocks[0].norm1.weight)`` after ``fully_shard(model)``.
    """
    # Found by the mesh's ranks, not its group handle: meshes of the same ranks compare equal,
    # and torch may hand a shard an equal mesh of an earlier, destroyed group (a process that
    # initializes the groups again, as the tests' persistent worlds do).
    mesh = tensor.device_mesh.mesh
    ranks = next(row for row in mesh.reshape(-1, mesh.shape[-1]).tolist() if dist.get_rank() in row)
    for group in (get_data_parallel_group(), get_data_parallel_group(with_context_parallel=True), *_hsdp("shard")):
        if dist.get_process_group_ranks(group) == ranks:
            return group
    raise ValueError(f"an FSDP shard over ranks {ranks}, neither the DP nor the DP x CP group: pass dp_group=")


def _hsdp(kind: str) -> list[dist.ProcessGroup]:
    """This rank's HSDP groups of ``kind`` ("shard" or "replicate") that :func:`hsdp_mesh` made."""
    return [group for name, group in GROUPS.items() if name.startswith("hsdp") and name.endswith(kind)]


def replica_group(tensor: DTensor) -> dist.ProcessGroup | None:
    """Under HSDP the group of this rank's replicas of an FSDP shard (its column of the mesh); else None."""
    mesh = tensor.device_mesh.mesh
    if mesh.ndim == 1:
        return None
    column = next(col for col in mesh.t().tolist() if dist.get_rank() in col)
    return next(group for group in _hsdp("replicate") if dist.get_process_group_ranks(group) == column)


def tp_dp_mesh(tp_group, *, dp_group=None) -> DeviceMesh | None:
    """The (TP, DP) mesh of this rank's TP group and ``dp_group`` (default: the DP group; under
    CP the DP x CP group FSDP shards over), in this pipeline stage; None at TP=1."""
    tp = comm.group_size(tp_group)
    if tp == 1:
        return None
    dp_group = dp_group if dp_group is not None else get_data_parallel_group()
    me = dist.get_rank()
    # The layout is a product of axes: TP rank t of DP rank d is d's rank shifted as t is from this one.
    tp_ranks = torch.tensor(dist.get_process_group_ranks(tp_group)) - me
    grid = tp_ranks[:, None] + torch.tensor(dist.get_process_group_ranks(dp_group))[None, :]
    return DeviceMesh.from_group([tp_group, dp_group], _device_type(tp_group), mesh=grid, mesh_dim_names=("tp", "dp"))


def full_box(tensor: DTensor, param, mesh: DeviceMesh | None) -> DTensor | None:
    """An FSDP shard as a box of the TP=1 tensor on the (TP, DP) ``mesh`` (:func:`tp_dp_mesh`),
    without communication, as DCP saves and loads it; None for a strided weight (fused Q|K|V,
    gate|up), whose DP shard is no box of it."""
    parallel = getattr(param, "tensor_model_parallel", False)
    if parallel and param.partition_stride != 1:
        return None
    if mesh is None:
        return tensor  # at TP=1 the FSDP DTensor already is one
    shape = list(tensor.shape)
    if parallel:
        dim = param.partition_dim % len(shape)
        shape[dim] *= mesh.size(0)
        placements = [Shard(dim), Shard(0)]   # a dim-0 DP split inside a dim-0 TP split nests
    else:
        placements = [Replicate(), Shard(0)]
    return DTensor.from_local(tensor.to_local(), mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
