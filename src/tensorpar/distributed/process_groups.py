"""Starting torch.distributed, choosing the rank's GPU, and creating process groups cheaply.

:class:`GroupMaker` creates one ``torch.distributed`` group per distinct rank list: the many
groups of a Megatron layout (TP, DP, model-parallel, expert, embedding, ...) coincide for most
sizes, and every gloo group costs a store rendezvous and sockets between its members. Every
rank must create the groups in the same order, so the lists are computed first (they are
the same on every rank) and created in that order. The world's own rank list reuses the
default group.

Example::

    maker = GroupMaker(timeout=None)
    tp_group = maker.make([0, 1])   # same object for a second [0, 1]
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist


def as_timedelta(timeout) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and timeout > 0:
        return datetime.timedelta(seconds=float(timeout))
    raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")


def init_default_group(backend: str | None, timeout: datetime.timedelta | None) -> None:
    """``init_process_group`` from torchrun's environment (clear error when it is missing)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "torch.distributed is not initialized and the torchrun environment variables "
            f"{missing} are not set: launch with `torchrun --nproc-per-node N ...` or call "
            "torch.distributed.init_process_group yourself before initialize_model_parallel"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {"backend": backend}
    if backend == "nccl":
        # Bound to the group, the device is the one barrier() and NCCL's communicators use (torch warns
        # on every barrier otherwise, and guesses from the current device).
        kwargs["device_id"] = select_cuda_device(int(os.environ["RANK"]))
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


def warn_if_overlap_unavailable() -> None:
    """The dgrad all-reduce overlaps the wgrad GEMM only with one CUDA hardware queue."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        warnings.warn("CUDA_DEVICE_MAX_CONNECTIONS is not 1: the async TP gradient all-reduce / "
                      "reduce-scatter may be scheduled after the wgrad GEMM instead of overlapping it. "
                      "Set CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment before the process starts "
                      "(tensorpar --nproc does it for CUDA runs)", stacklevel=4)


def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict):
    """``ProcessGroupNCCL.Options`` for group ``pg_name`` from ``nccl_comm_cfgs``, or None.

    Keys per group: ``is_high_priority_stream``, ``cga_cluster_size``, ``max_ctas``, ``min_ctas``,
    ``net_name`` ("IB" or "socket"), as Megatron's.
    """
    cfg = nccl_comm_cfgs.get(pg_name)
    if cfg is None:
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=cfg.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    if "net_name" in cfg and str(cfg["net_name"]).lower() not in ("ib", "socket"):
        raise RuntimeError(f"net_name {cfg['net_name']!r} for group {pg_name!r}: IB or socket")
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs: dict, pg_name: str, key_value_pair) -> None:
    """Set one option of group ``pg_name`` in ``nccl_comm_cfgs``."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


def create_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                 group_desc=None):
    """``torch.distributed.new_group`` with Megatron's keywords (every rank must call it)."""
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                          use_local_synchronization=use_local_synchronization, group_desc=group_desc)


class GroupMaker:
    """Creates each distinct (backend, ranks) group once; remembers what it created.

    The world's rank list reuses the default group when ``reuse_world`` (its timeout is then the
    default group's).
    """

    def __init__(self, *, timeout: datetime.timedelta | None, reuse_world: bool = True) -> None:
        self.timeout = timeout
        self.reuse_world = reuse_world
        self.created: list[dist.ProcessGroup] = []
        self._made: dict[tuple, dist.ProcessGroup] = {}
        self._world = tuple(range(dist.get_world_size()))
        self._default_backend = dist.get_backend()

    def make(self, ranks, *, backend: str | None = None, pg_options=None, desc: str | None = None,
             distinct: bool = False):
        """The group of ``ranks`` (this rank's handle, or a non-member marker); ``distinct`` (or
        NCCL options) gives a communicator of its own even when one with the same ranks exists."""
        if backend == self._default_backend:
            backend = None  # the default group's backend, whatever new_group calls it
        key = (backend, tuple(sorted(ranks)))
        distinct = distinct or pg_options is not None
        if not distinct and key in self._made:
            return self._made[key]
        if not distinct and self.reuse_world and key == (None, self._world):
            group = dist.group.WORLD
        else:
            group = dist.new_group(ranks=list(ranks), timeout=self.timeout, backend=backend,
                                   pg_options=pg_options, group_desc=desc)
            if dist.get_rank() in ranks:
                self.created.append(group)
        if not distinct:
            self._made[key] = group
        return group
