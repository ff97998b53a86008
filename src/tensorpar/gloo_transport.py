"""How tensorpar's collectives travel on gloo (CPU): as one all-to-all, waited by polling.

gloo's CPU collectives go round a ring, a round trip per step, each waking a thread on the peer;
its all-to-all is one exchange. :mod:`tensorpar.comm` sends a reduce-scatter, and an all-gather
or all-reduce within ``EXCHANGE_MAX_BYTES``, as one (:func:`start_exchange`; compiled, the
``tensorpar::exchange`` op; over 2 ranks :func:`start_swap`, the ``tensorpar::swap`` op) and
combines the blocks that arrive in rank order (:func:`fold`: the same bits on every rank). Between
ranks of one host the exchange goes through shared memory (:mod:`tensorpar.shared_memory`). Its
gloo works are waited by polling (:class:`YieldingWait`).

Example::

    received = torch.empty_like(t)
    start_swap(t, received, group).wait()       # over 2 ranks: an all-reduce
    total = fold([t, received] if group.rank() == 0 else [received, t], "sum")
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import shared_memory

__all__ = ["EXCHANGE_MAX_BYTES", "POLL_SECONDS", "SHARED_MEMORY_MAX_BYTES", "YieldingWait", "exchange_op", "exchanged",
           "fold", "launch", "spans_its_storage", "start_exchange", "start_swap", "swap_op", "through_shared_memory"]

# Over 2 ranks sharing 2 cores (benchmarks/gloo_collectives.py): a 256 KiB all-reduce took 1.65 ms
# as gloo's and 0.68 as one exchange, an 8 MiB reduce-scatter 8.8 ms against 4.1. An all-gather by
# all-to-all sends ``n`` copies of its input, to be made first; from about 4 MiB of them that costs
# more than the rounds save. An all-reduce by all-to-all sends every rank's tensor to every other
# rank: the ring's bytes over 2 ranks only.
EXCHANGE_MAX_BYTES = 2 << 20
# Through shared memory an exchange stacks no copies. Over 2 ranks running GEMMs, an all-reduce,
# all-gather and reduce-scatter of 16 MiB took 0.32x, 0.46x and 0.16x gloo's time; at 32 MiB the
# all-reduce took the same. Over 4 ranks (on 2 cores) an all-reduce, whose n blocks arrive whole,
# of 1 and 4 MiB took 0.53x and 0.73x gloo's ring's time, of 8 MiB 3.0x.
SHARED_MEMORY_MAX_BYTES = 16 << 20

_FOLDS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _contiguous_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def exchanged(tensor: torch.Tensor, group, *, copies: int = 0) -> bool:
    """Whether a collective of ``tensor`` goes as one exchange: on gloo, for CPU tensors, if the
    ``copies`` of the tensor its all-to-all sends come to ``EXCHANGE_MAX_BYTES`` at most, or if it
    goes :func:`through_shared_memory`."""
    if tensor.device.type != "cpu" or dist.get_backend(group) != "gloo":
        return False
    nbytes = tensor.numel() * tensor.element_size()
    return copies * nbytes <= EXCHANGE_MAX_BYTES or through_shared_memory(tensor, group, copies=max(copies, 1))


def through_shared_memory(tensor: torch.Tensor, group, *, copies: int = 1) -> bool:
    """Whether, run eagerly, a collective of ``tensor`` goes as one exchange through ``group``'s
    shared memory whatever its all-to-all would send: a CPU tensor on gloo whose ``copies`` (what
    arrives) come to ``SHARED_MEMORY_MAX_BYTES`` at most, and a group that shares memory. A
    compiled graph chooses its collectives when traced, before the group's segment is made
    (collectively, by its first exchange), and keeps to ``EXCHANGE_MAX_BYTES``."""
    return (tensor.device.type == "cpu" and dist.get_backend(group) == "gloo" and not torch.compiler.is_compiling()
            and copies * tensor.numel() * tensor.element_size() <= SHARED_MEMORY_MAX_BYTES
            and shared_memory.channel(group) is not None)


def start_exchange(source: torch.Tensor, copies: int, group, *, stable: bool = True
                   ) -> tuple[torch.Tensor, dist.Work]:
    """The exchange launched: the tensor the blocks arrive in, and the work to wait for. Through the
    group's shared memory where it has it (:func:`tensorpar.shared_memory.channel`), else as gloo's
    all-to-all, whose work holds the blocks it sends: a copy of ``source`` unless ``stable`` (it
    stays as it is until the wait)."""
    shared = shared_memory.channel(group)
    if shared is not None:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        arrived = source.new_empty((source.shape[0] * copies, *source.shape[1:]))
        blocks = arrived.view(n, -1)
        blocks[rank].copy_((source if copies > 1 else source.reshape(n, -1)[rank]).reshape(-1))
        into = [None if peer == rank else blocks[peer] for peer in range(n)]
        return arrived, shared.start(source, into, block=0 if copies > 1 else rank)
    if copies > 1:
        blocks = torch.cat([source] * copies)
    else:
        blocks = source.contiguous() if stable else source.clone(memory_format=torch.contiguous_format)
    arrived = torch.empty_like(blocks)
    return arrived, YieldingWait(dist.all_to_all_single(arrived, blocks, group=group, async_op=True))


def start_swap(send: torch.Tensor, received: torch.Tensor, group, *, stable: bool = True) -> dist.Work:
    """Over 2 ranks: ``send`` sent to the peer, the peer's into ``received`` (both contiguous, of one
    size). Through the group's shared memory where it has it, else an all-to-all without the
    rank's own block, and without the copies of ``send`` that :func:`start_exchange` stacks
    (benchmarks/even_shapes_vs_before.py: a TP=2 GPT step took 0.95x the time it took with
    exchanges), from a copy of ``send`` unless ``stable`` (it stays as it is until the wait)."""
    peer = 1 - dist.get_rank(group)
    shared = shared_memory.channel(group)
    if shared is not None:
        return shared.start(send, [received if rank == peer else None for rank in range(2)])
    if not stable:
        send = send.clone(memory_format=torch.contiguous_format)
    splits = [0, send.numel()] if peer else [send.numel(), 0]
    return YieldingWait(dist.all_to_all_single(received.view(-1), send.view(-1), output_split_sizes=splits,
                                               input_split_sizes=splits, group=group, async_op=True))


class YieldingWait(dist.Work):
    """A gloo work whose ``wait()`` polls it for up to ``POLL_SECONDS``, yielding the core between
    polls, before it sleeps in gloo's own wait. :mod:`tensorpar.comm`'s all-reduces, all-gathers,
    all-to-alls and broadcasts on gloo are waited so (gloo's reduce-scatter and point-to-point
    works report completion only once waited: polling them would only delay).

    A thread asleep in gloo's ``wait()`` leaves its core idle; on a VM an idle virtual CPU halts,
    and waking it for the result took milliseconds (a 64 KiB exchange between two ranks running
    GEMMs: median 1.7 ms asleep, 0.6 ms polling; 90th percentile 5.0 and 1.5 ms). Yielding lets
    the gloo threads, and ranks sharing the cores, run meanwhile; a longer wait (a peer far
    behind) sleeps rather than spend a core.

    Example::

        work = YieldingWait(dist.all_reduce(t, group=group, async_op=True))
        work.wait()
    """

    def __init__(self, work: dist.Work):
        super().__init__()
        self._work = work

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout=None) -> bool:
        give_up = time.perf_counter() + POLL_SECONDS
        while not self._work.is_completed() and time.perf_counter() < give_up:
            _yield_core()
        return self._work.wait()  # raises the collective's error, if it failed


POLL_SECONDS = 0.02
_yield_core = getattr(os, "sched_yield", lambda: time.sleep(0))


def launch(start: Callable[[bool], dist.Work | None], group, async_op: bool) -> dist.Work | None:
    """``start(async_op)``, a collective over ``group``: its work when ``async_op``, else None
    once it is done. On gloo it is started async and waited by polling (:class:`YieldingWait`)."""
    if dist.get_backend(group) != "gloo":
        return start(async_op)
    work = YieldingWait(start(True))
    if async_op:
        return work
    work.wait()
    return None


@torch.library.custom_op("tensorpar::exchange", mutates_args=())
def exchange_op(source: torch.Tensor, copies: int, group_name: str) -> torch.Tensor:
    """:func:`start_exchange` inside a compiled graph; the graph's ``wait_tensor`` of the
    result waits for it. Sent from a copy of ``source``: inductor may reuse its memory once the
    op returns, while the exchange still reads it."""
    arrived, work = start_exchange(source, copies, dist.distributed_c10d._resolve_process_group(group_name),
                                   stable=False)
    torch._C._distributed_c10d._register_work(arrived, work)
    return arrived


exchange_op.register_fake(lambda source, copies, group_name: source.new_empty((source.shape[0] * copies,
                                                                                *source.shape[1:])))


def spans_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is all of its memory: contiguous, from the storage's first byte to its last."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


@torch.library.custom_op("tensorpar::swap", mutates_args=())
def swap_op(source: torch.Tensor, group_name: str, halves: bool) -> torch.Tensor:
    """:func:`start_swap` of ``source`` inside a compiled graph (``halves``: of its two halves on dim 0,
    the peer's): what the peer sent, waited by the graph's ``wait_tensor``.

    Through shared memory ``source`` is copied when the op starts. Over gloo's all-to-all, a
    ``source`` that :func:`spans_its_storage` is sent from its own memory, which inductor reuses
    only after the graph's last read of it: the caller reads ``source`` after the wait
    (:mod:`tensorpar.comm` combines the rank's own part with the peer's). Copying it instead took
    1.5% of a compiled TP=2 GPT step (benchmarks/compile_step.py's model). Any other ``source`` (a
    slice of a larger buffer, whose other parts the graph may write anew while this one travels)
    is sent from a copy of the part sent, which the work holds.
    """
    group = dist.distributed_c10d._resolve_process_group(group_name)
    send = source[1 - dist.get_rank(group)] if halves else source
    received = _contiguous_like(send)
    torch._C._distributed_c10d._register_work(received, start_swap(send, received, group,
                                                                   stable=spans_its_storage(source)))
    return received


swap_op.register_fake(lambda source, group_name, halves: _contiguous_like(source[0] if halves else source))


def _fold_blocks(blocks, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
    result = _FOLDS[op](blocks[0], blocks[1], out=out)
    for block in blocks[2:]:
        result = _FOLDS[op](result, block, out=result)
    return result


@torch.library.custom_op("tensorpar::fold", mutates_args=())
def _fold_opaque(blocks: list[torch.Tensor], op: str) -> torch.Tensor:
    return _fold_blocks(blocks, op, out=_contiguous_like(blocks[0]))


_fold_opaque.register_fake(lambda blocks, op: _contiguous_like(blocks[0]))


def fold(blocks, op: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``blocks[0]`` (rank 0's block; ``blocks`` a sequence of tensors, or one stacked on dim 0)
    combined with ``blocks[1]``, then with ``blocks[2]``..., into ``out`` if given: the same order,
    so the same bits, on every rank. Compiled, a bf16 or fp16 fold stays opaque to inductor, which
    would otherwise fuse it into the ops that read it and skip rounding the result, as eager rounds
    it."""
    if torch.compiler.is_compiling() and blocks[0].dtype in (torch.bfloat16, torch.float16):
        result = _fold_opaque(list(blocks), op)
        return result if out is None else out.copy_(result)
    return _fold_blocks(blocks, op, out)
