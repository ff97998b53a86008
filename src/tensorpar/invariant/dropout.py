"""Dropout masks of the TP-invariant mode: pure functions of where they are, not of the rank.

A mask is drawn from a generator seeded by a hash of the run's seed, the training forward's
index (micro-batches trained so far), the dropout site (layer and place) and the global
coordinates of its elements: one generator per global attention head, one per fixed block of
the sequence (``BLOCKS`` blocks, so under SP a rank draws its own whole blocks). Neither the
TP size nor a generator's running state enters, so every TP size draws the same masks, a
recompute draws them again, and a resume at another TP size continues them.

Example::

    counter = MaskCounter(seed=1234)
    key = counter.next_key()                             # one per training forward
    h = dropout(h, 0.1, key=key, site=(0, "mlp"))        # h: [s, b, h], s divisible by BLOCKS
"""

from __future__ import annotations

import hashlib

import torch

from ..distributed import comm
from .layers import BLOCKS
from ..parallel_state import resolve_tp_group
from ..tensor_parallel.random import dropout as stream_dropout
from ..tensor_parallel.random import row_segments


def _hash(*parts) -> int:
    """A 63-bit hash of ``parts`` (ints and strings)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


class MaskCounter:
    """Hands each training forward its key, counting the forwards.

    ``counter`` is the number of micro-batches trained so far: a resume sets it to
    ``step x micro-batches per step`` (the training loop does).
    """

    def __init__(self, *, seed: int) -> None:
        self.seed, self.counter = seed, 0

    # Outside any compiled graph: a key that changes every forward would recompile it.
    @torch.compiler.disable
    def next_key(self) -> torch.Tensor:
        """The next forward's key: a hash of the seed and the counter, a 0-d int64 CPU tensor (a
        traced graph takes it as an input, and a recompute gets it back as a saved argument)."""
        key = torch.tensor(_hash(self.seed, self.counter))
        self.counter += 1
        return key


@torch.compiler.disable
def _keep(shape, p: float, key: torch.Tensor, sites: list[tuple], device) -> torch.Tensor:
    """``[len(sites), *shape]`` booleans, True at probability ``1 - p``; part ``i`` drawn from a
    generator seeded by ``(key, *sites[i])``."""
    keep = torch.empty(len(sites), *shape, dtype=torch.bool, device=device)
    generator, base = torch.Generator(device=device), int(key)
    for part, site in zip(keep, sites):
        generator.manual_seed(_hash(base, *site))
        # uniform >= p: on CPU faster than a boolean bernoulli_, and one draw on every device.
        torch.ge(torch.rand(shape, generator=generator, device=device), p, out=part)
    return keep


def dropout(input_: torch.Tensor, p: float, *, key: torch.Tensor | None, site: tuple, training: bool = True,
            sequence_parallel: bool = False, tp_group=None, valid_rows: int | None = None,
            row_starts: tuple[int, ...] | None = None, blocks: int = BLOCKS) -> torch.Tensor:
    """Dropout of ``input_`` (``[s, b, ...]``, or this rank's ``[s/TP, b, ...]`` under SP) with a
    mask of fixed sequence blocks, block ``i`` drawn from ``(key, site, i)``; without a ``key``,
    :func:`tensorpar.tensor_parallel.random.dropout` (``valid_rows``: its padding, ``row_starts``: its CP chunks).
    Keyed, ``row_starts`` places a CP rank's chunks in the sequence of ``valid_rows`` rows (the
    keyed mode's sequence divides into whole blocks, so it is never padded): each block's mask
    is the one its place in the whole sequence gets at CP = 1."""
    if key is None:
        return stream_dropout(input_, p, training=training, sequence_parallel=sequence_parallel, tp_group=tp_group,
                              valid_rows=valid_rows, row_starts=row_starts)
    if not training or p == 0.0:
        return input_
    rows, first_row, full_rows = input_.shape[0], 0, input_.shape[0]
    if sequence_parallel:
        group = resolve_tp_group(tp_group)
        first_row, full_rows = comm.group_rank(group) * rows, comm.group_size(group) * rows
    seq_rows = full_rows if row_starts is None else valid_rows
    segments = row_segments(first_row, rows, full_rows, row_starts)
    block = max(1, seq_rows // blocks)
    if seq_rows % blocks or any(start % block or count % block for start, count in segments):
        raise ValueError(f"tp_invariant dropout: the sequence length {seq_rows} is not divisible by the "
                         f"{blocks} fixed blocks (or this rank's {rows} rows are not whole blocks)")
    mine = [i for start, count in segments for i in range(start // block, (start + count) // block)]
    keep = _keep((block, *input_.shape[1:]), p, key, [(*site, i) for i in mine], input_.device)
    return input_ * keep.view(input_.shape) / (1.0 - p)


def drop_heads(probs: torch.Tensor, p: float, *, key: torch.Tensor, layer: int, first_head: int) -> torch.Tensor:
    """Dropout of the attention probabilities ``[b, heads, s, keys]`` of heads ``first_head..``,
    each head's mask drawn from ``(key, layer, global head)``."""
    b, heads, s, keys = probs.shape
    # Head-major, so each head's mask is one contiguous draw of the shape it has at TP = 1.
    keep = _keep((b, s, keys), p, key, [(layer, "attention", first_head + i) for i in range(heads)], probs.device)
    return probs * keep.transpose(0, 1) / (1.0 - p)
