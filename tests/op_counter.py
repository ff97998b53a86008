"""Count the aten operators a block of code dispatches (host syncs, per-parameter loops).

``aten._local_scalar_dense`` is what every device-to-host read (``float(t)``, ``t.item()``,
``if t:``) dispatches: counting it finds host synchronisations on CPU, where none is visible.
"""

from __future__ import annotations

import collections
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_SYNC = torch.ops.aten._local_scalar_dense.default


class OpCounter(TorchDispatchMode):
    def __init__(self, *, big: int | None = None) -> None:
        super().__init__()
        self.big = big
        self.counts: collections.Counter = collections.Counter()
        self.elements: collections.Counter = collections.Counter()  # of each op's first argument
        # results of ``big`` elements in new memory (not a view, in-place or out= result)
        self.fresh_big: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        if args and isinstance(args[0], torch.Tensor):
            self.elements[func] += args[0].numel()
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.numel() == self.big and not _shares_memory(result, args, kwargs):
            self.fresh_big[func] += 1
        return result

    @property
    def fresh_big_results(self) -> int:
        return sum(self.fresh_big.values())

    @property
    def host_syncs(self) -> int:
        return self.counts[HOST_SYNC]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _shares_memory(result: torch.Tensor, args, kwargs) -> bool:
    inputs = [t for t in [*args, *(kwargs or {}).values()] if isinstance(t, torch.Tensor)]
    return any(result.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in inputs)

