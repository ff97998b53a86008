"""The TP-independent state dict DCP saves and loads: model, Adam state and every rank's RNG.

Every TP-sharded tensor is a DTensor over the TP group whose global shape is what the TP=1
model holds; a strided weight (``partition_stride`` k) is viewed as ``[k, rows/k, ...]`` so
each rank's shard is one box of it; an uneven layout (``partition_rows``) is stored whole and
sharded again after a load. Under FSDP each shard is its box of the TP=1 tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..distributed import comm
from ..data_parallel.fsdp import full_box, gather_dp_shards, reshard, shard_group, tp_dp_mesh
from ..models.layout import gather_full_tensor, shard_full_tensor
from ..tensor_parallel.random import get_rng_tracker
from .checkpoint_format import ADAM_MOMENTS


def _global(local: torch.Tensor, mesh: DeviceMesh, shard_dim: int, global_shape: list[int]) -> DTensor:
    global_stride, running = [], 1
    for size in reversed(global_shape):
        global_stride.insert(0, running)
        running *= size
    return DTensor.from_local(local, mesh, [Shard(shard_dim)], run_check=False,
                              shape=torch.Size(global_shape), stride=tuple(global_stride))


def _sharded(tensor: torch.Tensor, param: torch.Tensor, mesh: DeviceMesh | None, ep_mesh: DeviceMesh | None = None):
    """``tensor`` (shaped like ``param``'s shard) as DCP should store it: a TP shard, or an
    expert weight's experts (dim 0 over EP), as its box of the whole tensor."""
    if getattr(param, "expert_parallel", False):
        if ep_mesh is None:
            return tensor
        return _global(tensor, ep_mesh, 0, [param.num_experts, *tensor.shape[1:]])
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    dim, stride = param.partition_dim % tensor.dim(), param.partition_stride
    tp = 1 if mesh is None else mesh.size()
    shape = list(tensor.shape)
    if stride == 1:
        local, shard_dim = tensor, dim
        global_shape = shape[:dim] + [shape[dim] * tp] + shape[dim + 1:]
    else:
        local = tensor.view(shape[:dim] + [stride, shape[dim] // stride] + shape[dim + 1:])
        shard_dim = dim + 1
        global_shape = shape[:dim] + [stride, shape[dim] * tp // stride] + shape[dim + 1:]
    if mesh is None:
        return local
    return _global(local, mesh, shard_dim, global_shape)


def _stored(tensor: torch.Tensor, param: torch.Tensor, mesh: DeviceMesh | None, tp_group, ep_mesh=None):
    """``tensor`` as DCP should store it: :func:`_sharded`, or for an uneven layout
    (``partition_rows``, which no DTensor placement describes) the full tensor, gathered, in
    the same global shape, so a checkpoint moves between even and uneven TP sizes."""
    rows = getattr(param, "partition_rows", None)
    if rows is None:
        return _sharded(tensor, param, mesh, ep_mesh)
    full = gather_full_tensor(tensor, partition_dim=param.partition_dim, stride=param.partition_stride,
                              tp_group=tp_group, partition_rows=rows)
    dim, stride, shape = param.partition_dim % full.dim(), param.partition_stride, list(full.shape)
    return full if stride == 1 else full.view(shape[:dim] + [stride, shape[dim] // stride] + shape[dim + 1:])


def param_targets(name: str, param: torch.Tensor, optimizer) -> dict[str, torch.Tensor]:
    """The state-dict keys of parameter ``name`` and the tensors a load fills: its data and,
    with an optimizer, its Adam moments."""
    targets = {f"model.{name}": param.data}
    if optimizer is not None:
        targets.update({f"optim.{name}.{key}": optimizer.state[param][key] for key in ADAM_MOMENTS})
    return targets


@torch.no_grad()
def unstore(state: dict, uneven: list, tp_group) -> None:
    """Copy the loaded full tensors of uneven layouts (``uneven``: :func:`build_state_dict`'s
    ``(key, this rank's TP shard, parameter)``) into this rank's shards."""
    for key, target, param in uneven:
        rows = param.partition_rows
        dim = param.partition_dim % target.dim()
        full_shape = list(target.shape)
        full_shape[dim] = max(b for ranges in rows for _, b in ranges)
        target.copy_(shard_full_tensor(state[key].reshape(full_shape), partition_dim=dim, tp_group=tp_group,
                                       partition_rows=rows))


def _mesh(group) -> DeviceMesh | None:
    if group is None or comm.group_size(group) == 1:
        return None
    device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device_type)


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint keeps (a router's expert bias), by name: those in the module's
    state dict. Every rank holds them whole."""
    return {name: value for name, value in model.state_dict(keep_vars=True).items()
            if not isinstance(value, torch.nn.Parameter)}


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create zero Adam state for parameters that have none, so DCP can load into it (the step
    count where AdamW keeps it: on the parameter's device for the fused or capturable kernels)."""
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                for key in ADAM_MOMENTS:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _rng_state() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    for name, state in get_rng_tracker().get_states().items():
        states[f"tracker.{name}"] = state
    return states


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states.pop("cpu"))
    if "cuda" in states:
        torch.cuda.set_rng_state(states.pop("cuda"))
    get_rng_tracker().set_states({k.removeprefix("tracker."): v for k, v in states.items()})


def rng_spec() -> dict[str, list[int]]:
    """This rank's RNG entries and their shapes, as ``meta.json`` records them."""
    return {name: list(state.shape) for name, state in _rng_state().items()}


@torch.no_grad()
def build_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                     tp_group, with_rng: bool, ep_group=None) -> tuple[dict, list, list]:
    """The flat DCP state dict (``model.*``, ``buffer.*``, ``optim.*`` and, with ``with_rng``,
    this rank's ``rng.*``), the (FSDP shard, gathered copy) pairs a load copies back, and the
    entries of uneven layouts a load shards again (:func:`unstore`). Expert weights are their
    boxes of the whole ``[experts, ...]`` tensor over ``ep_group``.

    Under :func:`tensorpar.fully_shard` each FSDP shard is saved as its box of the TP=1
    tensor on the (TP, DP) mesh (DP x CP under CP; the stage's ranks under PP), so the files are the same with and without FSDP; a strided
    weight's DP shard is no such box: it is gathered over DP to its TP shard first (and copied
    back after a load), which a save or load holds on every rank for a moment.
    """
    mesh, ep_mesh = _mesh(tp_group), _mesh(ep_group)
    # FSDP keeps the root unit gathered after a forward with no backward (an evaluation): its
    # registered parameters are then the gathered copies, not the shards the optimizer steps.
    reshard(model)
    shard = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    fsdp_mesh = None if shard is None else tp_dp_mesh(tp_group, dp_group=shard_group(shard))
    state, gathered, uneven = {}, [], []

    def enter(key, tensor, param):
        if isinstance(tensor, DTensor) and (box := full_box(tensor, param, fsdp_mesh)) is not None:
            state[key] = box
            return
        whole = gather_dp_shards(tensor)
        if whole is not tensor:
            gathered.append((tensor, whole))
        state[key] = _stored(whole, param, mesh, tp_group, ep_mesh)
        if getattr(param, "partition_rows", None) is not None:
            uneven.append((key, whole, param))

    for name, p in model.named_parameters():
        enter(f"model.{name}", p.data, p)
        if optimizer is not None:
            moments = optimizer.state[p]
            state[f"optim.{name}.step"] = moments["step"]
            for key in ADAM_MOMENTS:
                enter(f"optim.{name}.{key}", moments[key], p)
    for name, buffer in persistent_buffers(model).items():
        state[f"buffer.{name}"] = buffer
    if with_rng:
        for key, value in _rng_state().items():
            state[f"rng.rank{dist.get_rank()}.{key}"] = value
    return state, gathered, uneven
