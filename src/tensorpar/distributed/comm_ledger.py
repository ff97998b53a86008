"""``CommLedger``, which records every collective tensorpar issues (:mod:`tensorpar.distributed.comm`).

Shapes and bytes in records are those of the *full* tensor of the collective: the gathered
output of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce, the tensor
one rank sends in a ``send_recv`` (a ring step: send to one peer, receive from another). Under
``torch.compile`` a ledger records each execution of the compiled graph.

Example::

    with tp.CommLedger() as ledger:
        out, _ = layer(x)
        out.sum().backward()
    print(ledger.summary())
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

_RING_SEND_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


@dataclasses.dataclass(frozen=True)
class CommRecord:
    """One collective: ``bytes`` is the full tensor's size, ``phase`` the ledger's label."""

    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bytes: int
    group_size: int
    async_op: bool
    phase: str | None = None
    reduce_op: str | None = None

    @property
    def bytes_sent_per_rank(self) -> float:
        """Bytes each rank sends under a ring algorithm."""
        return bytes_sent_per_rank(self.op, self.bytes, self.group_size)


def bytes_sent_per_rank(op: str, nbytes: int, group_size: int) -> float:
    """Bytes each rank sends for collective ``op`` of a ``nbytes`` tensor under a ring algorithm."""
    return nbytes * _RING_SEND_FACTOR[op](group_size)


_ACTIVE_LEDGERS: list["CommLedger"] = []


class CommLedger:
    """Context manager recording every collective tensorpar issues while it is active.

    ``ledger.phase("backward")`` labels the records made inside it. Ledgers nest: each active
    ledger records every collective.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._phase: str | None = None

    def __enter__(self) -> "CommLedger":
        _ACTIVE_LEDGERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE_LEDGERS.remove(self)

    @contextlib.contextmanager
    def phase(self, name: str):
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = previous

    def clear(self) -> None:
        self.records.clear()

    def filter(self, *, op: str | None = None, phase: str | None = None) -> list[CommRecord]:
        return [r for r in self.records
                if (op is None or r.op == op) and (phase is None or r.phase == phase)]

    def count(self, op: str | None = None, *, phase: str | None = None) -> int:
        return len(self.filter(op=op, phase=phase))

    def total_bytes(self, op: str | None = None, *, phase: str | None = None) -> int:
        return sum(r.bytes for r in self.filter(op=op, phase=phase))

    def ops(self, phase: str | None = None) -> list[str]:
        return [r.op for r in self.filter(phase=phase)]

    def summary(self) -> str:
        lines = [f"{'phase':<10} {'op':<15} {'shape':<22} {'dtype':<15} {'bytes':>12} {'async':>6}"]
        for r in self.records:
            lines.append(f"{r.phase or '-':<10} {r.op:<15} {str(list(r.shape)):<22} "
                         f"{str(r.dtype).replace('torch.', ''):<15} {r.bytes:>12} {str(r.async_op):>6}")
        return "\n".join(lines)


def record(op: str, tensor: torch.Tensor, group_size: int, async_op: bool, reduce_op: str | None = None,
           *, shape: list[int] | None = None) -> None:
    """Record collective ``op`` of ``tensor`` in every active ledger: of its ``shape`` where that
    is not the tensor's own (an all-gather's gathered output)."""
    if not _ACTIVE_LEDGERS:
        return
    shape = [int(s) for s in (tensor.shape if shape is None else shape)]
    if torch.compiler.is_compiling():
        # Traced once, run every step: an op with a side effect records each execution of the
        # compiled graph (forward and backward). Only graphs traced while a ledger is active
        # carry it: opening a ledger recompiles once. The op reads the tensor, which gives it a
        # device: inductor emits its pending fused kernels before an op with one, and frees their
        # inputs after them (before an op without one it freed the inputs and emitted the kernel
        # after, reading freed memory).
        torch.ops.tensorpar.record_collective(tensor, op, shape, group_size, async_op, reduce_op)
    else:
        _append_record(op, shape, tensor.dtype, group_size, async_op, reduce_op)


def _append_record(op: str, shape: list[int], dtype: torch.dtype, group_size: int, async_op: bool,
                   reduce_op: str | None) -> None:
    numel = 1
    for s in shape:
        numel *= s
    for ledger in _ACTIVE_LEDGERS:
        ledger.records.append(CommRecord(op, dtype, tuple(shape), numel * dtype.itemsize, group_size, async_op,
                                         ledger._phase, reduce_op))


@torch.library.custom_op("tensorpar::record_collective", mutates_args=())
def _record_compiled(tensor: torch.Tensor, op: str, shape: list[int], group_size: int, async_op: bool,
                     reduce_op: str | None) -> None:
    _append_record(op, shape, tensor.dtype, group_size, async_op, reduce_op)


_record_compiled.register_fake(lambda *args: None)
torch.library._register_effectful_op("tensorpar::record_collective", torch.library.EffectType.ORDERED)


def record_p2p(op: str, tensor: torch.Tensor) -> None:
    """Record a point-to-point ``send`` or ``recv`` of ``tensor`` (between two ranks) that
    another engine issues: torch.distributed.pipelining's stages (:mod:`tensorpar.pipeline_parallel`)."""
    record(op, tensor, 2, True)
