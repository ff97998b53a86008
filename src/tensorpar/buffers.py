"""``GlobalMemoryBuffer``: scratch tensors reused across layers, on any device.

Sequence parallelism all-gathers each layer's input into a tensor it needs only until the GEMM
has run; one buffer per (name, dtype, device), grown on demand, serves every layer in turn.
Megatron's version allocates on the current CUDA device only; this one takes the device from
the caller, so SP runs on CPU too.
"""

from __future__ import annotations

import math

import torch


class GlobalMemoryBuffer:
    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get_tensor(self, shape, dtype: torch.dtype, name: str,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """A tensor of ``shape`` viewing the named scratch buffer (contents undefined)."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device, requires_grad=False)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


_GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    return _GLOBAL_MEMORY_BUFFER
