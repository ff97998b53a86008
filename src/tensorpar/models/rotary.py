"""Rotary position embeddings (RoPE), with Llama 3's frequency scaling."""

from __future__ import annotations

import math

import torch

from .config import LLAMA3_SCALING, GPTConfig


def rotary_frequencies(config: GPTConfig) -> torch.Tensor:
    """The ``head_dim / 2`` rotary angular frequencies, with Llama 3's scaling if configured."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if config.rope_scaling is None:
        return inv_freq
    # Llama 3: long wavelengths slowed down by `factor`, short ones kept, a smooth blend between.
    factor, low, high, context = (config.rope_scaling[k] for k in LLAMA3_SCALING)
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelength > context / low, inv_freq / factor,
                       torch.where(wavelength < context / high, inv_freq, blended))


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, *, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the rotary angles at ``positions``: ``[..., s, head_dim]`` each."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RotaryTables:
    """``cos``/``sin`` of positions ``0 .. length - 1``, built once per device and dtype.

    Example::

        cos, sin = RotaryTables(config, length=config.max_seq_len).at(None, seq_len, device, dtype)
    """

    def __init__(self, config: GPTConfig, *, length: int) -> None:
        self.inv_freq, self.length, self._built = rotary_frequencies(config), length, {}

    def at(self, position_ids: torch.Tensor | None, seq_len: int, device: torch.device, dtype: torch.dtype):
        """The tables at ``position_ids`` (``None``: the first ``seq_len`` positions)."""
        tables = self._built.get((device, dtype))
        if tables is None:
            tables = rotary_tables(torch.arange(self.length, device=device), self.inv_freq, dtype=dtype)
            if not torch.compiler.is_compiling():  # traced, a cache filled in the graph would recompile it
                self._built[(device, dtype)] = tables
        if position_ids is None:
            return tuple(t[:seq_len] for t in tables)
        return tuple(t[position_ids] for t in tables)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., s, head_dim]``) by position, pairing dim ``i`` with ``i + head_dim/2``."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin
