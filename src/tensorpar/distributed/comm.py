"""Every collective tensorpar issues.

All functions work on any device and backend (gloo on CPU, NCCL on CUDA). With a group of one
rank they do nothing and record nothing. A tensor made for a collective (a scalar, a timing)
goes on :func:`collective_device` (:func:`scalars` makes one there). ``async_op=True`` returns a :class:`Handle`; call
``wait()`` on it before reading the result. Every collective is recorded by the active
:class:`~tensorpar.distributed.comm_ledger.CommLedger` (re-exported here).

Every one is torch's own: ``torch.distributed`` run eagerly, its functional collectives under
``torch.compile`` (traceable), so a CPU run on gloo takes the code path a GPU run on NCCL takes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .comm_ledger import CommLedger, CommRecord, bytes_sent_per_rank, record as _record, record_p2p

__all__ = ["CommLedger", "CommRecord", "Handle", "all_gather", "all_reduce", "all_to_all", "broadcast",
           "bytes_sent_per_rank", "check_divisible", "collective_device", "group_rank", "group_size",
           "record_p2p", "reduce_scatter", "scalars", "send_recv"]


# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names.
def _all_gather_single(output: torch.Tensor, input: torch.Tensor, **kwargs):
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(output, input, **kwargs)


def _reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, **kwargs):
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(output, input, **kwargs)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Handle:
    """Work in flight; ``wait()`` finishes it and returns its result.

    ``work`` is None, one thing with ``wait()`` (a collective's work, another handle) or a list
    of them; ``wait()`` waits for each, then gives ``finish(result)`` (``result`` without
    ``finish``). Every in-flight result in tensorpar is one: a collective with ``async_op=True``,
    a chunked pipeline (:mod:`tensorpar.tensor_parallel.overlap`), a reduction started for interleaving
    (:func:`tensorpar.start_reduction_from_tensor_model_parallel_region`). Waiting again returns
    the same result.

    Example::

        handle = comm.all_reduce(grad, group, async_op=True)
        other = compute()                  # runs while the sum travels
        grad = handle.wait()
    """

    def __init__(self, work, result, finish: Callable | None = None):
        self._work = [] if work is None else list(work) if isinstance(work, (list, tuple)) else [work]
        self._result, self._finish = result, finish

    def wait(self):
        for work in self._work:
            work.wait()
        self._work = []
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result


def _launched(op: str, tensor: torch.Tensor, *args) -> torch.Tensor:
    """Functional collective ``op`` launched, not waited: ``funcol``'s wrappers put a wait right
    after the launch while tracing, which kept the compiled backward from overlapping the dgrad
    all-reduce with the wgrad GEMM (the wait is :func:`_traced`'s, where eager code waits)."""
    return getattr(torch.ops._c10d_functional, op)(tensor, *args)


def _traced(result: torch.Tensor, async_op: bool, finish: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """A launched functional collective's ``result`` (under ``torch.compile``), waited now or by
    ``Handle.wait``.

    The wait stays where eager code waits, so compute traced between launch and wait (the
    wgrad GEMM) can overlap the collective in the compiled graph too.
    """
    def wait(t: torch.Tensor) -> torch.Tensor:
        t = funcol.wait_tensor(t)
        return finish(t) if finish is not None else t

    return Handle(None, result, wait) if async_op else wait(result)


def _done(result: torch.Tensor, async_op: bool):
    return Handle(None, result) if async_op else result


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: the CPU under gloo, the rank's
    current accelerator device under any other backend (NCCL refuses CPU tensors)."""
    if dist.get_backend(group) == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    kind = torch.accelerator.current_accelerator().type
    return torch.device(kind, torch.get_device_module(kind).current_device())


def scalars(values, group: dist.ProcessGroup | None = None, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values`` (a number or a list of them) as a tensor on ``group``'s collective device.

    Example::

        worst = comm.all_reduce(comm.scalars([seconds], group, dtype=torch.float64), group, op="max")
    """
    return torch.tensor(values, dtype=dtype, device=collective_device(group))


def check_divisible(size: int, parts: int, what: str) -> None:
    if size % parts != 0:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size ({parts})")


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, op: str = "sum",
               async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group``; returns it (or a Handle)."""
    n = group_size(group)
    if n == 1:
        return _done(tensor, async_op)
    _record("all_reduce", tensor, n, async_op, op)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace process-group calls; torch's functional collectives it can.
        return _traced(_launched("all_reduce", tensor, op, group.group_name), async_op, tensor.copy_)
    work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    return Handle(work, tensor) if async_op else tensor


# gloo runs these on CUDA tensors (several ranks sharing one GPU); the rest go through host memory.
_GLOO_CUDA_COLLECTIVES = ("all_reduce", "broadcast")


def _staged_on_host(op: str, tensor: torch.Tensor, group) -> bool:
    return tensor.is_cuda and op not in _GLOO_CUDA_COLLECTIVES and dist.get_backend(group) == "gloo"


def _on_host(collective, tensor: torch.Tensor, out: torch.Tensor | None, async_op: bool):
    """``collective`` on a host copy of ``tensor``, its result copied back (synchronously)."""
    result = collective(tensor.cpu())
    result = result.to(tensor.device) if out is None else out.copy_(result)
    return _done(result, async_op)


def _place(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return result.contiguous() if out is None else out.copy_(result)


def _uneven(sizes, group, what: str) -> bool:
    """Whether ``sizes`` (one extent per rank) are unequal."""
    if sizes is None:
        return False
    sizes = list(sizes)
    if len(sizes) != group_size(group) or any(not isinstance(s, int) or s < 0 for s in sizes):
        raise ValueError(f"{what}: sizes must be one non-negative int per rank of the group of "
                         f"{group_size(group)}, got {sizes}")
    return len(set(sizes)) > 1


def _padded(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` zero-padded at the end of ``dim`` to ``size``."""
    pad = size - tensor.shape[dim]
    if pad == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = pad
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def _gather_uneven(tensor: torch.Tensor, group, dim: int, sizes, async_op: bool):
    """All-gather of shards of unequal ``sizes``: each padded to the largest, the padding cut."""
    if tensor.shape[dim] != sizes[group_rank(group)]:
        raise ValueError(f"all_gather: this rank's tensor has {tensor.shape[dim]} along dimension {dim}, "
                         f"sizes say {sizes[group_rank(group)]}")
    largest = max(sizes)
    inner = all_gather(_padded(tensor, dim, largest), group, dim=dim, async_op=async_op)

    def unpad(gathered: torch.Tensor) -> torch.Tensor:
        return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(gathered.split(largest, dim), sizes)],
                         dim=dim)

    if async_op:
        return Handle(inner, None, lambda _: unpad(inner.wait()))
    return unpad(inner)


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, *, dim: int = 0,
               async_op: bool = False, out: torch.Tensor | None = None, sizes=None):
    """Concatenate every rank's ``tensor`` along ``dim``.

    ``out`` (dim 0 only) is a preallocated result, e.g. a ``GlobalMemoryBuffer`` tensor.
    ``sizes`` (every rank's extent along ``dim``) allows shards of unequal size: each travels
    padded to the largest (the ledger records the padded collective).
    """
    dim = dim % tensor.dim()
    if _uneven(sizes, group, "all_gather"):
        if out is not None:
            raise ValueError("all_gather: `out` is not supported with unequal sizes")
        return _gather_uneven(tensor, group, dim, list(sizes), async_op)
    n = group_size(group)
    if n == 1:
        return _done(tensor if out is None else out.copy_(tensor), async_op)
    if _staged_on_host("all_gather", tensor, group):
        return _on_host(lambda t: all_gather(t, group, dim=dim), tensor, out, async_op)
    shape = list(tensor.shape)
    shape[dim] *= n
    _record("all_gather", tensor, n, async_op, shape=shape)
    if torch.compiler.is_compiling():
        return _traced(_launched("all_gather_into_tensor", tensor.movedim(dim, 0).contiguous(), n, group.group_name),
                       async_op, lambda t: _place(t.movedim(0, dim) if dim else t, out))
    stacked_shape = [tensor.shape[dim] * n if d == 0 else s for d, s in enumerate(tensor.shape)]
    if dim == 0:
        result = out if out is not None else tensor.new_empty(stacked_shape)
        finish = None
    else:
        if out is not None:
            raise ValueError("all_gather: `out` is supported for dim 0 only")
        source = tensor.movedim(dim, 0).contiguous()
        stacked_shape = [source.shape[0] * n] + list(source.shape[1:])
        result = tensor.new_empty(stacked_shape)
        tensor = source

        def finish(t: torch.Tensor) -> torch.Tensor:
            return t.movedim(0, dim).contiguous()

    work = _all_gather_single(result, tensor.contiguous(), group=group, async_op=async_op)
    if async_op:
        return Handle(work, result, finish)
    return finish(result) if finish else result


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup, *, dim: int = 0,
                   async_op: bool = False, op: str = "sum", out: torch.Tensor | None = None, sizes=None):
    """Sum ``tensor`` over ``group`` and keep this rank's slice along ``dim``.

    ``out`` (dim 0 only) is a preallocated contiguous result, e.g. a slice of a larger output.
    ``sizes`` (every rank's slice along ``dim``, summing to the tensor's) allows unequal
    slices: each travels padded to the largest.
    """
    dim = dim % tensor.dim()
    if _uneven(sizes, group, "reduce_scatter"):
        sizes = list(sizes)
        if sum(sizes) != tensor.shape[dim]:
            raise ValueError(f"reduce_scatter: sizes {sizes} do not sum to dimension {dim} of shape "
                             f"{list(tensor.shape)}")
        largest, rank = max(sizes), group_rank(group)
        padded = torch.cat([_padded(piece, dim, largest) for piece in tensor.split(sizes, dim)], dim=dim)
        inner = reduce_scatter(padded, group, dim=dim, async_op=async_op, op=op)

        def unpad(result: torch.Tensor) -> torch.Tensor:
            mine = result.narrow(dim, 0, sizes[rank])
            return mine.contiguous() if out is None else out.copy_(mine)

        return Handle(inner, None, lambda _: unpad(inner.wait())) if async_op else unpad(inner)
    n = group_size(group)
    if n == 1:
        return _done(tensor if out is None else out.copy_(tensor), async_op)
    if _staged_on_host("reduce_scatter", tensor, group):
        return _on_host(lambda t: reduce_scatter(t, group, dim=dim, op=op), tensor, out, async_op)
    check_divisible(tensor.shape[dim], n, f"reduce-scatter dimension {dim} of shape {list(tensor.shape)}")
    _record("reduce_scatter", tensor, n, async_op, op)
    if out is not None and dim != 0:
        raise ValueError("reduce_scatter: `out` is supported for dim 0 only")
    if torch.compiler.is_compiling():
        return _traced(_launched("reduce_scatter_tensor", tensor.movedim(dim, 0).contiguous(), op, n, group.group_name),
                       async_op, lambda t: _place(t.movedim(0, dim) if dim else t, out))
    source = tensor.movedim(dim, 0).contiguous() if dim != 0 else tensor.contiguous()
    out_shape = [source.shape[0] // n] + list(source.shape[1:])
    result = out if out is not None else source.new_empty(out_shape)
    work = _reduce_scatter_single(result, source, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    finish = (lambda t: t.movedim(0, dim).contiguous()) if dim != 0 else None
    if async_op:
        return Handle(work, result, finish)
    return finish(result) if finish else result


def all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup, *,
               output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None) -> torch.Tensor:
    """Exchange dim-0 slices: slice ``i`` of the input goes to rank ``i``."""
    n = group_size(group)
    if n == 1:
        return tensor
    if _staged_on_host("all_to_all", tensor, group):
        return _on_host(lambda t: all_to_all(t, group, output_split_sizes=output_split_sizes,
                                             input_split_sizes=input_split_sizes), tensor, None, False)
    _record("all_to_all", tensor, n, False)
    if torch.compiler.is_compiling():
        return _traced(funcol.all_to_all_single(tensor.contiguous(), output_split_sizes, input_split_sizes,
                                                group), False)
    tensor = tensor.contiguous()
    if output_split_sizes is None:
        out = torch.empty_like(tensor)
    else:
        out = tensor.new_empty([sum(output_split_sizes)] + list(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor, output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=group)
    return out


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place broadcast from global rank ``src``."""
    n = group_size(group)
    if n == 1:
        return tensor
    _record("broadcast", tensor, n, False)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def send_recv(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, *, send_to: int,
              recv_from: int, async_op: bool = False, tag: int = 0):
    """Send ``send`` to group rank ``send_to`` while receiving ``recv`` (in place) from group rank
    ``recv_from``: one step of a ring. Returns ``recv`` (or a Handle). Exchanges in flight at
    once between the same ranks should differ in ``tag`` (gloo matches by it; NCCL by order).

    Example::

        n, r = comm.group_size(group), comm.group_rank(group)
        pending = comm.send_recv(kv, torch.empty_like(kv), group, send_to=(r + 1) % n,
                                 recv_from=(r - 1) % n, async_op=True)
        partial = attend(q, kv)            # runs while the next block travels
        kv = pending.wait()
    """
    n = group_size(group)
    if n == 1:
        return _done(recv.copy_(send), async_op)
    if send.shape != recv.shape or send.dtype != recv.dtype:
        raise ValueError(f"send_recv: send {list(send.shape)} {send.dtype} and recv {list(recv.shape)} "
                         f"{recv.dtype} must match")
    _record("send_recv", send, n, async_op)
    staged = _staged_on_host("send_recv", send, group)
    outgoing, incoming = (send.cpu(), recv.cpu()) if staged else (send.contiguous(), recv)
    if not incoming.is_contiguous():
        raise ValueError("send_recv: recv must be contiguous")
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, outgoing, dist.get_global_rank(group, send_to), group, tag),
        dist.P2POp(dist.irecv, incoming, dist.get_global_rank(group, recv_from), group, tag)])
    # The send buffer must live until its work is done: the handle keeps it.
    handle = Handle(works, (incoming, outgoing), lambda pair: recv.copy_(pair[0]) if staged else pair[0])
    return handle if async_op else handle.wait()
