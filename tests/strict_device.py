"""Collectives that refuse a tensor not on the backend's device, as NCCL refuses a CPU tensor.

On the CPU suite every tensor is on the CPU, so a tensor made without a device (``torch.zeros(())``)
meets gloo's needs by luck; under NCCL the same line hands a CPU tensor to a CUDA collective.
Inside ``strict_collective_device(group)`` such a tensor lands on ``meta`` instead (torch's
default device), and every collective (each ``c10d`` operator) checks that its tensors are on
``comm.collective_device(group)``, raising before gloo sees them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tensorpar.distributed import comm


class _RequireDevice(TorchDispatchMode):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and leaf.device != self.device:
                    raise RuntimeError(f"{func}: a tensor on {leaf.device}, but this backend's collectives "
                                       f"need {self.device}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def strict_collective_device(group=None):
    required = comm.collective_device(group)
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        with _RequireDevice(required):
            yield
    finally:
        torch.set_default_device(previous)
