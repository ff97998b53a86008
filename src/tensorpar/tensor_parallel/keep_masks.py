"""Dropout keep masks: drawn in seeded blocks, eagerly or inside a ``torch.compile`` graph.

:func:`block_keep_mask` is the mask of :func:`tensorpar.tensor_parallel.random.dropout`: blocks of whole dim-0
rows of the full tensor, block ``k`` from a generator seeded by one base draw and ``k``, so a
rank draws only the blocks its rows fall in. Traced, generators cannot be swapped: on CPU the
graph draws the base (:func:`graph_seed`) and an opaque op draws the blocks from it
(:func:`traced_block_keep_mask`); on other devices :func:`traced_keep_mask` draws one mask for
the whole tensor from the default stream (which every TP rank advances alike) and each rank
keeps its slice.

Example::

    keep = block_keep_mask(h.shape, 0.9, h.device, [(rank * rows, rows)], full_rows=tp * rows)
    keep = traced_keep_mask(probs.shape, 0.9, probs.device, dim=1, start=rank * heads, full=all_heads)
"""

from __future__ import annotations

import math

import torch

from .initialization import slab_seed

__all__ = ["DROPOUT_BLOCK_ELEMENTS", "block_keep_mask", "graph_seed", "traced_block_keep_mask", "traced_keep_mask"]

# A mask is drawn in blocks of about this many elements (whole rows of dim 0).
DROPOUT_BLOCK_ELEMENTS = 1 << 20


def block_keep_mask(shape, keep_prob: float, device, segments: list[tuple[int, int]], full_rows: int,
                    base: int | None = None) -> torch.Tensor:
    """The block-drawn mask of ``full_rows`` rows at this tensor's rows: ``segments`` give, in
    order, the first row and count of each run of them; rows from ``full_rows`` on (padding)
    are False. ``base``: the blocks' seed base (default: one draw of the default stream)."""
    keep = torch.empty(shape, dtype=torch.bool, device=device)
    if keep.numel() == 0:
        return keep
    view = keep.view(shape[0], -1) if keep.dim() else keep.view(1, 1)
    rows_per_block = max(1, DROPOUT_BLOCK_ELEMENTS // view.shape[1])
    # One draw from the CPU default generator: no device synchronisation.
    base = int(torch.randint(0, 1 << 62, (1,))) if base is None else base
    generator, local = torch.Generator(device=device), 0
    for first_row, count in segments:
        _fill_rows(view[local:local + count], keep_prob, first_row, full_rows, rows_per_block, base, generator)
        local += count
    return keep


def _fill_rows(view: torch.Tensor, keep_prob: float, first_row: int, full_rows: int, rows_per_block: int,
               base: int, generator: torch.Generator) -> None:
    """Write rows ``[first_row, first_row + len(view))`` of the block-drawn mask into ``view``."""
    view[max(0, full_rows - first_row):].fill_(False)
    last_row = min(first_row + view.shape[0], full_rows)
    if last_row <= first_row:
        return
    for block in range(first_row // rows_per_block, math.ceil(last_row / rows_per_block)):
        start, stop = block * rows_per_block, min((block + 1) * rows_per_block, full_rows)
        generator.manual_seed(slab_seed(base, block))
        lo, hi = max(start, first_row), min(stop, last_row)
        if (lo, hi) == (start, stop):
            _draw_keep(view[lo - first_row:hi - first_row], keep_prob, generator)
        else:  # a block across this run's edge: draw it whole, keep our rows
            whole = _draw_keep(view.new_empty((stop - start, view.shape[1])), keep_prob, generator)
            view[lo - first_row:hi - first_row] = whole[lo - start:hi - start]


def _draw_keep(out: torch.Tensor, keep_prob: float, generator: torch.Generator) -> torch.Tensor:
    """``out`` (booleans) True where a uniform draw from ``generator`` falls below ``keep_prob``. On
    CPU twice as fast as a boolean ``bernoulli_`` (512 Ki elements, one core of an AMD EPYC: 1.2
    ms against 2.4), which drew 1.2 M of them in 5.4 ms of an 80 ms TP=2 GPT step."""
    return torch.lt(torch.rand(out.shape, generator=generator, device=out.device), keep_prob, out=out)


def graph_seed() -> torch.Tensor:
    """Traced: a base for a mask's seeds, drawn by the graph (a 0-dim CPU tensor). A random op the
    compiler knows: it neither merges two draws into one (two masks of one shape stay two) nor
    draws anew for a recompute, which an opaque op drawing from the default stream would."""
    return torch.randint(0, 1 << 62, ())


def traced_block_keep_mask(shape, keep_prob: float, device, segments: list[tuple[int, int]],
                           full_rows: int) -> torch.Tensor:
    """:func:`block_keep_mask` inside a compiled graph. On CPU the same blocks, from a base the graph
    draws: inductor's own generator, element by element, took 6x as long as ATen's (512 Ki
    elements, one core: 7.8 ms against 1.2) and made a compiled TP=2 GPT step with dropout 0.1
    slower than the eager one. Elsewhere the rows of one mask drawn for all ``full_rows``."""
    if torch.device(device).type == "cpu":
        flat = [number for segment in segments for number in segment]
        return _block_keep_mask_op(graph_seed(), list(shape), keep_prob, flat, full_rows)
    if len(segments) == 1:
        return traced_keep_mask(shape, keep_prob, device, dim=0, start=segments[0][0], full=full_rows)
    end = max(start + count for start, count in segments)
    whole = traced_keep_mask((end, *shape[1:]), keep_prob, device, dim=0, start=0, full=full_rows)
    return torch.cat([whole.narrow(0, start, count) for start, count in segments])


@torch.library.custom_op("tensorpar::block_keep_mask", mutates_args=())
def _block_keep_mask_op(seed: torch.Tensor, shape: list[int], keep_prob: float, segments: list[int],
                        full_rows: int) -> torch.Tensor:
    pairs = list(zip(segments[::2], segments[1::2]))
    return block_keep_mask(shape, keep_prob, seed.device, pairs, full_rows, base=int(seed))


_block_keep_mask_op.register_fake(lambda seed, shape, *_: torch.empty(shape, dtype=torch.bool, device=seed.device))


def traced_keep_mask(shape, keep_prob: float, device, *, dim: int, start: int, full: int) -> torch.Tensor:
    """Slice ``[start, start + shape[dim])`` along ``dim`` of a keep mask drawn for ``full``, in
    memory of its own: saved for backward, a view would keep the whole mask alive (TP times this
    rank's attention masks, measured on a compiled TP=2 GPT).

    Generators are not traceable: this draws with one ``rand`` of the full shape, identical on
    ranks whose default streams agree; on CPU with ATen's generator, seeded by :func:`graph_seed`.
    """
    if torch.device(device).type == "cpu":
        return _seeded_keep_mask(graph_seed(), list(shape), keep_prob, dim, start, full)
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
    generator = torch.Generator().manual_seed(int(seed))
    return _keep_slice(lambda full_shape: torch.rand(full_shape, generator=generator) < keep_prob,
                       shape, dim=dim, start=start, full=full)


_seeded_keep_mask.register_fake(lambda seed, shape, *_: torch.empty(shape, dtype=torch.bool, device=seed.device))
