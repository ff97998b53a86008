"""TP collectives split into chunks, each overlapped with the GEMM that produces or consumes it.

Two pipelines cover every collective on a TP layer's critical path (the names follow PyTorch's
async-TP ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``, but these run eagerly,
on any device and backend):

* :func:`all_gather_matmul`: ``all_gather(x, dim 0) @ rhs``. Each rank's ``x`` is cut into
  ``chunks`` row blocks; chunk ``i + 1`` is gathered while chunk ``i``'s GEMM runs (one
  batched GEMM over the ranks' blocks, written straight into their rows of the result). Under
  SP: the column layer's forward, and the row layer's backward (the output grad's all-gather
  against the dgrad GEMM).
* :func:`matmul_reduce`: ``all_reduce(x @ rhs)`` or ``reduce_scatter(x @ rhs, dim 0)``. Chunk
  ``i``'s collective runs while chunk ``i + 1``'s GEMM computes. The row layer's forward ``g``
  (all-reduce, or reduce-scatter under SP), and the column layer's dgrad reduction.

Chunks split the sequence (dim 0), i.e. the GEMM's rows only: each output element is the same
dot product as in the unchunked GEMM. It is not always the same bits: a GEMM over fewer rows (or
a batched one) may run another kernel that sums in another order, and a chunk's all-reduce or
reduce-scatter may add the ranks' partials in another order than the whole tensor's. Results
agree with the unchunked ones to rounding; gathered data are exact. ``chunks`` is capped at the
rows available; uneven splits are fine (every rank splits the same way).

Device and stream safety: collectives are issued with ``async_op=True`` through
:mod:`tensorpar.distributed.comm`. On CUDA, ProcessGroupNCCL runs them on its own stream after an event
on the issuing stream, keeps their tensors alive until completion, and ``wait()`` makes the
issuing stream wait for them; every handle here is waited before its buffer is read or handed
back, and scratch buffers are named per pipeline, so no buffer is reused while in flight.

``overlap="auto"`` picks the chunk count per layer from a link model
(:class:`tensorpar.planning.communication.LinkModel`) whose figures :func:`measure_link` measures, once,
when :func:`tensorpar.calibrate_overlap` is called.

:func:`interleave` works one level up (Domino, Wang et al. 2024): it splits a micro-batch into
independent parts and interleaves them, so one part's collectives are in flight while another
part computes.

Example (the SP column forward, 4 chunks)::

    out = all_gather_matmul(x_shard, weight.t(), group, chunks=4, bias=bias)
"""

from __future__ import annotations

import math
import statistics
import time
import warnings

import torch

from ..distributed import comm
from .buffers import get_global_memory_buffer


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s accelerator (CPU work is done when it returns),
    so that a clock read after it times that work."""
    if device.type != "cpu":
        torch.accelerator.synchronize()


def median_seconds(fn, device: torch.device, reps: int = 5) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_link(group, *, device: torch.device, dtype: torch.dtype, rows: int, gemm: tuple[int, int],
                 comm_elements: int) -> dict[str, float]:
    """Measure on ``group`` what a chunk count is chosen from: collective (every rank of ``group``).

    Times a ``[rows, gemm[0]] @ gemm`` GEMM, a one-element all-reduce (latency), an all-reduce of
    ``comm_elements`` (bandwidth) and both at once (how much of the shorter one hides); with a
    layer's real shapes, so that neither is launch-bound where the layer is not. Every figure is
    the worst over the ranks, so all ranks decide alike. Returns :class:`tensorpar.planning.communication.LinkModel`'s
    fields. Its collectives go through :mod:`tensorpar.distributed.comm` (a ``CommLedger`` records them).
    """
    n = comm.group_size(group)
    a = torch.randn(rows, gemm[0], dtype=dtype, device=device)
    b = torch.randn(*gemm, dtype=dtype, device=device)
    small, big = torch.zeros(1, dtype=dtype, device=device), torch.zeros(comm_elements, dtype=dtype, device=device)
    gemm_s = median_seconds(lambda: a @ b, device)
    latency_s = median_seconds(lambda: comm.all_reduce(small, group), device)
    big_s = median_seconds(lambda: comm.all_reduce(big, group), device)
    big_sent = comm.bytes_sent_per_rank("all_reduce", big.numel() * big.element_size(), n)
    gemms = max(1, round(big_s / gemm_s))  # about as long as the big all-reduce

    def both():
        work = comm.all_reduce(big, group, async_op=True)
        for _ in range(gemms):
            a @ b
        work.wait()

    hidden = gemms * gemm_s + big_s - median_seconds(both, device)
    overlap = min(1.0, max(0.0, hidden / min(gemms * gemm_s, big_s)))
    # Worst case over the ranks (max of times, min of overlap): one decision everywhere.
    worst = comm.scalars([latency_s, max(big_s - latency_s, 1e-9) / big_sent, gemm_s, -overlap], group,
                         dtype=torch.float64)
    latency_s, seconds_per_byte, gemm_s, overlap = comm.all_reduce(worst, group, op="max").tolist()
    return dict(latency_s=latency_s, bytes_per_s=1 / seconds_per_byte,
                flops_per_s=2 * rows * gemm[0] * gemm[1] / gemm_s, overlap=-overlap)


def chunk_sizes(rows: int, chunks: int) -> list[int]:
    """Sizes of ``min(chunks, rows)`` consecutive row blocks, as even as possible (larger first)."""
    parts = max(1, min(chunks, rows))
    base, extra = divmod(rows, parts)
    return [base + (i < extra) for i in range(parts)]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, features]`` view (``t`` is contiguous)."""
    return t.view(-1, t.shape[-1])


def _scratch(shape, dtype, device, name: str) -> torch.Tensor:
    return get_global_memory_buffer().get_tensor(shape, dtype, name, device=device)


def all_gather_matmul(shard: torch.Tensor, rhs: torch.Tensor, group, *, chunks: int,
                      bias: torch.Tensor | None = None, keep_gathered: bool = False):
    """``all_gather(shard, dim 0) @ rhs (+ bias)``, gathering chunk ``i + 1`` during chunk ``i``'s GEMM.

    ``shard``: ``[s/TP, ..., k]`` on every rank; ``rhs``: ``[k, n]``. Returns the product
    ``[s, ..., n]`` in sequence order and, with ``keep_gathered``, ``all_gather(shard, dim 0)``
    itself (``[s, ..., k]``, sequence order), else None. Each chunk is one batched GEMM over the
    ranks' rows, written straight into their places in the result.
    """
    n = comm.group_size(group)
    shard = shard.contiguous()
    rows, inner, k = shard.shape[0], math.prod(shard.shape[1:-1]), shard.shape[-1]
    out = shard.new_empty([n * rows, *shard.shape[1:-1], rhs.shape[1]])
    out_by_rank = out.view(n, rows * inner, rhs.shape[1])
    kept = shard.new_empty([n * rows, *shard.shape[1:]]) if keep_gathered else None
    sizes = chunk_sizes(rows, chunks)
    pieces = shard.split(sizes)
    # Chunk i's gather lands as [TP, rows_i, ...]: rank-major, so not in sequence order.
    received = _scratch([n * rows, *shard.shape[1:]], shard.dtype, shard.device, "overlap_gather")
    received = received.split([n * s for s in sizes])
    rhs_by_rank = rhs.expand(n, *rhs.shape)

    def launch(i: int):
        return comm.all_gather(pieces[i], group, async_op=True, out=received[i])

    in_flight = launch(0)
    start = 0
    for i, size in enumerate(sizes):
        handle = in_flight
        if i + 1 < len(sizes):
            in_flight = launch(i + 1)  # gathers while this chunk's GEMM runs
        handle.wait()
        chunk = received[i].view(n, size * inner, k)
        rows_out = out_by_rank[:, start * inner:(start + size) * inner]
        if bias is None:
            torch.bmm(chunk, rhs_by_rank, out=rows_out)
        else:
            torch.baddbmm(bias, chunk, rhs_by_rank, out=rows_out)
        if kept is not None:
            kept.view(n, rows * inner, k)[:, start * inner:(start + size) * inner].copy_(chunk)
        start += size
    return out, kept


def matmul_reduce(x: torch.Tensor, rhs: torch.Tensor, group, *, chunks: int, scatter: bool,
                  async_op: bool = False):
    """``all_reduce(x @ rhs)``, or with ``scatter`` ``reduce_scatter(x @ rhs, dim 0)``, chunked.

    ``x``: ``[s, ..., k]``; ``rhs``: ``[k, n]``. Chunk ``i``'s collective is in flight while
    chunk ``i + 1``'s GEMM runs. Under ``scatter`` each chunk is rows ``i`` of every rank's
    sequence slice, GEMM'd into a scratch buffer and reduce-scattered into this rank's result.
    With ``async_op`` returns a :class:`tensorpar.distributed.comm.Handle` (the last chunks may still be in flight).
    """
    x = x.contiguous()
    n = comm.group_size(group)
    feature_shape = [*x.shape[1:-1], rhs.shape[1]]
    handles = []
    if not scatter:
        out = x.new_empty([x.shape[0], *feature_shape])
        start = 0
        for size in chunk_sizes(x.shape[0], chunks):
            rows_out = out[start:start + size]
            torch.mm(_rows(x[start:start + size]), rhs, out=_rows(rows_out))
            handles.append(comm.all_reduce(rows_out, group, async_op=True))
            start += size
    else:
        comm.check_divisible(x.shape[0], n, f"reduce-scatter dimension 0 of shape {list(x.shape)}")
        rows, inner = x.shape[0] // n, math.prod(x.shape[1:-1])
        x_by_rank = x.view(n, rows * inner, x.shape[-1])
        rhs_by_rank = rhs.expand(n, *rhs.shape)
        out = x.new_empty([rows, *feature_shape])
        sizes = chunk_sizes(rows, chunks)
        # Chunks in flight must not share scratch rows: one buffer holds all of them.
        scratch = _scratch([n * rows, *feature_shape], x.dtype, x.device, "overlap_reduce")
        start = 0
        for part, size in zip(scratch.split([n * s for s in sizes]), sizes):
            # One batched GEMM: rows ``start:start + size`` of every rank's sequence slice.
            torch.bmm(x_by_rank[:, start * inner:(start + size) * inner], rhs_by_rank,
                      out=part.view(n, size * inner, rhs.shape[1]))
            handles.append(comm.reduce_scatter(part, group, async_op=True, out=out[start:start + size]))
            start += size
    pending = comm.Handle(handles, out)
    return pending if async_op else pending.wait()


def interleave(x: torch.Tensor, stages, *, parts: int = 2, dim: int = 1) -> torch.Tensor:
    """Run ``stages`` on ``parts`` slices of ``x`` along ``dim`` (the batch of ``[s, b, h]``),
    interleaved so that each slice's collectives are in flight while other slices compute.

    Each stage is ``(start, finish)``: ``start(h)`` computes up to a collective and returns it in
    flight (anything with ``wait()``, e.g. :meth:`tensorpar.RowParallelLinear.start`);
    ``finish(h, result)`` is the slice's value after the stage. Slice ``j``'s stage ``k``
    collective travels while slices ``j + 1, ...`` start stage ``k`` and slices ``..., j - 1``
    run stage ``k + 1``. The slices are independent, so the result is the un-split one's (the
    same numbers whenever nothing in the stages mixes the batch; dropout draws its masks per
    slice). Fewer than ``parts`` rows along ``dim`` make fewer parts, with a warning.

    Example (a pre-norm transformer block)::

        def residual(h, result):
            return h + result[0]
        y = interleave(x, [(lambda h: attn_proj.start(attention(norm1(h))), residual),
                           (lambda h: mlp_proj.start(mlp(norm2(h))), residual)])
    """
    slices = list(x.chunk(parts, dim=dim))
    if len(slices) < parts:
        # Shown once per size (Python's default warning filter): a silent no-op hides a config error.
        warnings.warn(f"interleave: {x.shape[dim]} rows along dim {dim} make {len(slices)} part(s), not the {parts} "
                      f"asked for (1 part overlaps nothing): interleaving needs at least {parts} sequences per "
                      "micro-batch", stacklevel=2)
    if not stages:
        return x
    pending = [stages[0][0](h) for h in slices]
    for k, (_, finish) in enumerate(stages):
        for j, h in enumerate(slices):
            slices[j] = finish(h, pending[j].wait())
            if k + 1 < len(stages):
                pending[j] = stages[k + 1][0](slices[j])
    return torch.cat(slices, dim=dim)
