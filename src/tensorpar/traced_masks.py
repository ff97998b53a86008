"""Dropout masks inside a ``torch.compile`` graph, where generators cannot be swapped: one mask
drawn for the whole tensor from the default stream (which every TP rank advances alike), of
which each rank keeps its slice (:mod:`tensorpar.random`'s dropout, traced).

Example::

    keep = traced_keep_mask(probs.shape, 0.9, probs.device, dim=1, start=rank * heads, full=all_heads)
    probs = probs * keep / 0.9
"""

from __future__ import annotations

import torch

__all__ = ["traced_keep_mask"]


def traced_keep_mask(shape, keep_prob: float, device, *, dim: int, start: int, full: int) -> torch.Tensor:
    """Slice ``[start, start + shape[dim])`` along ``dim`` of a keep mask drawn for ``full``, in
    memory of its own: saved for backward, a view would keep the whole mask alive (TP times this
    rank's attention masks, measured on a compiled TP=2 GPT).

    Generators are not traceable: this draws from the default stream with one ``rand`` of the
    full shape, identical on ranks whose default streams agree. On CPU the graph draws a seed and
    an opaque op the mask from it with ATen's generator: inductor's own, element by element, took
    6x as long (512 Ki elements, one core: 7.8 ms against 1.2) and made a compiled TP=2 GPT step
    with dropout 0.1 slower than the eager one. The seed is the graph's own random draw, which the
    compiler neither merges with another (two masks of one shape stay two) nor draws anew for a
    recompute.
    """
    if torch.device(device).type == "cpu":
        seed = torch.randint(0, 1 << 62, (), device=device)
        return _seeded_keep_mask(seed, list(shape), keep_prob, dim, start, full)
    return _keep_slice(lambda full_shape: torch.rand(full_shape, device=device) < keep_prob, shape,
                       dim=dim, start=start, full=full)


def _keep_slice(draw, shape, *, dim: int, start: int, full: int) -> torch.Tensor:
    """Slice ``[start, start + shape[dim])`` along ``dim`` of ``draw(full_shape)``, a copy; past
    ``full`` (SP padding) False."""
    full_shape = list(shape)
    if not shape:
        return draw(full_shape)
    full_shape[dim] = full
    keep = draw(full_shape)
    padding = start + shape[dim] - full
    if padding > 0:  # positions past the real ones (SP padding): dropped
        full_shape[dim] = padding
        keep = torch.cat([keep, keep.new_zeros(full_shape)], dim=dim)
    return keep.narrow(dim, start, shape[dim]).clone()


@torch.library.custom_op("tensorpar::seeded_keep_mask", mutates_args=())
def _seeded_keep_mask(seed: torch.Tensor, shape: list[int], keep_prob: float, dim: int, start: int,
                      full: int) -> torch.Tensor:
    generator = torch.Generator(device=seed.device).manual_seed(int(seed))
    return _keep_slice(lambda full_shape: torch.rand(full_shape, generator=generator, device=seed.device) < keep_prob,
                       shape, dim=dim, start=start, full=full)


_seeded_keep_mask.register_fake(lambda seed, shape, *_: torch.empty(shape, dtype=torch.bool, device=seed.device))
