"""``GlobalMemoryBuffer``: scratch tensors reused across layers, on any device.

Sequence parallelism all-gathers each layer's input into a tensor it needs only until the GEMM
has run; one buffer per (name, dtype, device), grown on demand, serves every layer in turn.
Megatron's version allocates on the current CUDA device only; this one takes the device from
the caller, so SP runs on CPU too.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from ..parallel_state import default_device


class GlobalMemoryBuffer:
    """Scratch tensors reused across calls, one per (name, dtype, device), grown on demand.

    Example::

        buf = tp.get_global_memory_buffer().get_tensor([s, b, h], torch.float32, "mpu")
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype: torch.dtype, name: str, mem_alloc_context=None, *,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """A tensor of ``tensor_shape`` viewing the named scratch buffer (contents undefined).

        Megatron's arguments: ``mem_alloc_context`` (a callable returning a context manager)
        wraps a new allocation. ``device`` defaults to the backend's (the rank's GPU under NCCL).

        Example::

            scratch = get_global_memory_buffer().get_tensor([s, b, h], torch.bfloat16, "tp_input")
        """
        if isinstance(mem_alloc_context, (str, torch.device)):
            warnings.warn("get_tensor(shape, dtype, name, device) is deprecated: the fourth positional "
                          "argument is Megatron's mem_alloc_context; pass device=", DeprecationWarning, stacklevel=2)
            mem_alloc_context, device = None, mem_alloc_context
        device = torch.device(device) if device is not None else default_device()
        numel = math.prod(tensor_shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            with (mem_alloc_context or contextlib.nullcontext)():
                buffer = torch.empty(numel, dtype=dtype, device=device, requires_grad=False)
            self._buffers[key] = buffer
        return buffer[:numel].view(tensor_shape)

    def clear(self) -> None:
        self._buffers.clear()


_GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    return _GLOBAL_MEMORY_BUFFER
