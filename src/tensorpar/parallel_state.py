"""Tensor- and data-parallel process groups.

TP groups are blocks of consecutive ranks (so a TP group stays inside one node when
``torchrun`` places consecutive ranks on a node); the DP group of a rank is every rank with
the same TP rank. With world size 8 and TP=2: TP groups {0,1} {2,3} {4,5} {6,7}, DP groups
{0,2,4,6} {1,3,5,7}.

Example::

    import tensorpar as tp
    tp.initialize_model_parallel(2)          # reads RANK/WORLD_SIZE/MASTER_* from torchrun
    tp.get_tensor_model_parallel_rank()      # 0 or 1
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_DP_GROUP: dist.ProcessGroup | None = None
_TP_GLOBAL_RANKS: list[int] | None = None
_DP_GLOBAL_RANKS: list[int] | None = None
_OWNS_DEFAULT_GROUP = False
_DEVICE: torch.device | None = None


def _as_timedelta(timeout) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and timeout > 0:
        return datetime.timedelta(seconds=float(timeout))
    raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")


def _init_default_group(backend: str | None, timeout: datetime.timedelta | None) -> None:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "torch.distributed is not initialized and the torchrun environment variables "
            f"{missing} are not set: launch with `torchrun --nproc-per-node N ...` or call "
            "torch.distributed.init_process_group yourself before initialize_model_parallel"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        select_cuda_device(int(os.environ["RANK"]))
    kwargs = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(**kwargs)


def select_cuda_device(rank: int) -> torch.device:
    """This rank's GPU under NCCL: ``LOCAL_RANK`` (torchrun's), else ``rank`` modulo the devices;
    the only one when the process sees one (``CUDA_VISIBLE_DEVICES`` per task, as
    ``srun --gpus-per-task=1`` sets it).

    Made current with ``torch.cuda.set_device``. A different device chosen before (a current
    device other than 0, or the NCCL group's bound ``device_id``) is a clear error, not a
    silent second GPU.
    """
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("the NCCL backend needs a CUDA device, and none is visible")
    local_rank = os.environ.get("LOCAL_RANK")
    if count == 1:
        index, source = 0, "the one visible CUDA device"
    elif local_rank is not None:
        index, source = int(local_rank), f"LOCAL_RANK={local_rank}"
    else:
        index, source = rank % count, f"rank {rank} modulo {count} devices"
    if index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise RuntimeError(f"{source} selects cuda:{index}, but only {count} CUDA devices are visible{seen}: "
                           "give each local rank its own device, or every process all of the node's")
    chosen = []
    if dist.is_initialized():
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
        if bound is not None:
            chosen.append(("the process group's device_id", bound.index))
    current = torch.cuda.current_device()
    if current != 0:
        chosen.append(("torch.cuda.set_device", current))
    for what, other in chosen:
        if other != index:
            raise RuntimeError(f"{what} chose cuda:{other} but {source} selects cuda:{index}; make them agree "
                               "(one GPU per local rank)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _warn_if_overlap_unavailable() -> None:
    """The dgrad all-reduce overlaps the wgrad GEMM only with one CUDA hardware queue."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        warnings.warn("CUDA_DEVICE_MAX_CONNECTIONS is not 1: the async TP gradient all-reduce / "
                      "reduce-scatter may be scheduled after the wgrad GEMM instead of overlapping it. "
                      "Set CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment before the process starts "
                      "(tensorpar --nproc does it for CUDA runs)", stacklevel=3)


def initialize_model_parallel(tensor_model_parallel_size: int = 1, *, backend: str | None = None,
                              timeout=None) -> None:
    """Create the TP and DP groups, initialising the default process group first if needed.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise; ``timeout``
    (seconds or ``timedelta``) bounds every collective, so a peer that never joins raises
    instead of hanging. Under NCCL the rank's GPU is selected (:func:`select_cuda_device`)
    whoever created the process group.
    """
    global _TP_GROUP, _DP_GROUP, _TP_GLOBAL_RANKS, _DP_GLOBAL_RANKS, _OWNS_DEFAULT_GROUP, _DEVICE
    if _TP_GROUP is not None:
        raise RuntimeError("tensorpar model parallel is already initialized; call "
                           "destroy_model_parallel() first")
    if not isinstance(tensor_model_parallel_size, int) or tensor_model_parallel_size < 1:
        raise ValueError(f"tensor_model_parallel_size must be a positive int, got "
                         f"{tensor_model_parallel_size!r}")
    timeout = _as_timedelta(timeout)
    if not dist.is_initialized():
        _init_default_group(backend, timeout)
        _OWNS_DEFAULT_GROUP = True
    world_size = dist.get_world_size()
    if world_size % tensor_model_parallel_size != 0:
        raise ValueError(f"world size {world_size} is not divisible by "
                         f"tensor_model_parallel_size {tensor_model_parallel_size}")
    rank = dist.get_rank()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        # Before any group exists: NCCL communicators bind to the current device.
        device = select_cuda_device(rank)
        _warn_if_overlap_unavailable()
    tp = tensor_model_parallel_size
    kwargs = {} if timeout is None else {"timeout": timeout}
    # Every rank must create every group, in the same order.
    for start in range(0, world_size, tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            _TP_GROUP, _TP_GLOBAL_RANKS = group, ranks
    for first in range(tp):
        ranks = list(range(first, world_size, tp))
        group = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            _DP_GROUP, _DP_GLOBAL_RANKS = group, ranks
    _DEVICE = device


def model_parallel_is_initialized() -> bool:
    return _TP_GROUP is not None


def destroy_model_parallel() -> None:
    """Forget the TP/DP groups; also tears down the default group if tensorpar created it."""
    global _TP_GROUP, _DP_GROUP, _TP_GLOBAL_RANKS, _DP_GLOBAL_RANKS, _OWNS_DEFAULT_GROUP, _DEVICE
    for group in (_TP_GROUP, _DP_GROUP):
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
    _TP_GROUP = _DP_GROUP = _TP_GLOBAL_RANKS = _DP_GLOBAL_RANKS = _DEVICE = None
    if _OWNS_DEFAULT_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_DEFAULT_GROUP = False


def _require_initialized(what: str) -> None:
    if _TP_GROUP is None:
        raise RuntimeError(f"{what} needs tensorpar model parallel: call "
                           "tensorpar.initialize_model_parallel(...) first, or pass tp_group=")


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's TP group; with ``check_initialized=False``, ``None`` before initialisation (as Megatron)."""
    if check_initialized:
        _require_initialized("get_tensor_model_parallel_group()")
    return _TP_GROUP


def get_data_parallel_group() -> dist.ProcessGroup:
    _require_initialized("get_data_parallel_group()")
    return _DP_GROUP


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(get_tensor_model_parallel_group())


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(get_tensor_model_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(get_data_parallel_group())


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(get_data_parallel_group())


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (the broadcast source for a TP group)."""
    _require_initialized("get_tensor_model_parallel_src_rank()")
    return _TP_GLOBAL_RANKS[0]


def get_tensor_model_parallel_global_ranks() -> list[int]:
    _require_initialized("get_tensor_model_parallel_global_ranks()")
    return list(_TP_GLOBAL_RANKS)


def get_data_parallel_global_ranks() -> list[int]:
    _require_initialized("get_data_parallel_global_ranks()")
    return list(_DP_GLOBAL_RANKS)


def resolve_tp_group(tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The explicit group if given, else the initialized TP group (clear error if neither)."""
    if tp_group is not None:
        return tp_group
    _require_initialized("this tensorpar layer or mapping")
    return _TP_GROUP


def default_device() -> torch.device:
    """Where layers put their parameters when ``device=None``: the backend's device."""
    if _DEVICE is not None:
        return _DEVICE
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
