"""The static KV cache of generation: every layer's keys and values, allocated once."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for this rank's K/V heads, ``[b, groups/TP, capacity, d]``.

    Allocated once for the whole generation and written in place: a forward with the cache
    attends over the ``length`` cached positions plus its own, writes its own after them and
    advances ``length``. Build it with :meth:`GPT.new_kv_cache`.
    """

    def __init__(self, *, num_layers: int, shape: tuple[int, int, int, int], dtype, device) -> None:
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` (``[b, groups/TP, s, d]``) after the cached ones; all of them, so far."""
        if self.length + k.shape[2] > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot take {k.shape[2]} more "
                             f"after {self.length}")
        return self.write(layer, self.length, k, v)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` at positions ``start...``, unchecked (the decode step checks once
        per token); the keys and values of positions ``0..`` up to them, as views."""
        stop = start + k.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, start:stop] = k
        values[:, :, start:stop] = v
        return keys[:, :, :stop], values[:, :, :stop]

    def write_at(self, layer: int, position: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store ``k``, ``v`` (``[b, groups/TP, 1, d]``) at the slot in ``position`` (a one-element
        device tensor: no host sync, the same shapes every call); the whole buffers."""
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, position, k)
        values.index_copy_(2, position, v)
        return keys, values
