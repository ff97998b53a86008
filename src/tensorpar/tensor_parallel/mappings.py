"""Autograd region mappings: each forward paired with its conjugate backward.

The paper's two operators (Megatron-LM, Shoeybi et al. 2019, section 3):

* ``f`` = :func:`copy_to_tensor_model_parallel_region`: forward identity, backward all-reduce.
  Sits where a replicated activation enters a column-parallel layer.
* ``g`` = :func:`reduce_from_tensor_model_parallel_region`: forward all-reduce, backward
  identity. Sits where a row-parallel layer's partial sums leave.

Sequence parallelism replaces them with all-gather / reduce-scatter along the sequence
dimension (dim 0 of ``[s, b, h]``). Every mapping is the identity for a group of one rank.
Every function takes ``(input_, group=None)`` (``gather_from_sequence_parallel_region`` takes
``tensor_parallel_output_grad`` second, as Megatron's); ``group=None`` means the TP group.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..distributed import comm
from ..parallel_state import resolve_tp_group


def split_along_dim(tensor: torch.Tensor, group, dim: int, what: str = "tensor", sizes=None) -> torch.Tensor:
    """This rank's contiguous slice of ``tensor`` along ``dim`` (of ``sizes[rank]`` if given)."""
    n, rank = comm.group_size(group), comm.group_rank(group)
    dim = dim % tensor.dim()
    if sizes is not None:
        if len(sizes) != n or sum(sizes) != tensor.shape[dim]:
            raise ValueError(f"{what} dimension {dim} of shape {list(tensor.shape)} cannot be split into "
                             f"sizes {list(sizes)} over {n} ranks")
        return tensor.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()
    comm.check_divisible(tensor.shape[dim], n, f"{what} dimension {dim} of shape {list(tensor.shape)}")
    return tensor.chunk(n, dim=dim)[rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, input_, group, inplace_grad):
        ctx.group, ctx.inplace_grad = group, inplace_grad
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        if not (ctx.inplace_grad and grad_output.is_contiguous()):
            # A private copy: the incoming gradient may be a tensor someone else still reads.
            grad_output = grad_output.clone(memory_format=torch.contiguous_format)
        return comm.all_reduce(grad_output, ctx.group), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, input_, group, inplace):
        # Compiled, the sum is out of place anyway (functional collectives); the compiler reuses memory.
        if inplace and input_.is_contiguous() and not torch.compiler.is_compiling():
            ctx.mark_dirty(input_)
            return comm.all_reduce(input_, group)
        return comm.all_reduce(input_.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None


class _SplitRegion(torch.autograd.Function):
    """Keep this rank's slice along ``dim``; backward all-gathers it."""

    @staticmethod
    def forward(ctx, input_, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return split_along_dim(input_, group, dim, sizes=sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return comm.all_gather(grad_output, ctx.group, dim=ctx.dim, sizes=ctx.sizes), None, None, None


class _GatherRegion(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's slice (or reduce-scatters it)."""

    @staticmethod
    def forward(ctx, input_, group, dim, reduce_grad, sizes):
        ctx.group, ctx.dim, ctx.reduce_grad, ctx.sizes = group, dim, reduce_grad, sizes
        return comm.all_gather(input_, group, dim=dim, sizes=sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduce_grad:
            grad = comm.reduce_scatter(grad_output, ctx.group, dim=ctx.dim, sizes=ctx.sizes)
        else:
            grad = split_along_dim(grad_output, ctx.group, ctx.dim, "gradient", sizes=ctx.sizes)
        return grad, None, None, None, None


class _ReduceScatterRegion(torch.autograd.Function):
    """Reduce-scatter along ``dim``; backward all-gathers."""

    @staticmethod
    def forward(ctx, input_, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return comm.reduce_scatter(input_, group, dim=dim, sizes=sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return comm.all_gather(grad_output, ctx.group, dim=ctx.dim, sizes=ctx.sizes), None, None, None


class _StartReduction(torch.autograd.Function):
    """g (all-reduce in place), or under SP the reduce-scatter, launched and not waited.

    The output holds the result only after :class:`_FinishReduction`; backward is g's
    (identity) or the reduce-scatter's (all-gather).
    """

    @staticmethod
    def forward(ctx, input_, group, scatter, handles):
        ctx.group, ctx.scatter = group, scatter
        if scatter:
            n = comm.group_size(group)
            comm.check_divisible(input_.shape[0], n, f"reduce-scatter dimension 0 of shape {list(input_.shape)}")
            out = input_.new_empty([input_.shape[0] // n, *input_.shape[1:]])
            handles.append(comm.reduce_scatter(input_, group, async_op=True, out=out))
            return out
        ctx.mark_dirty(input_)
        handles.append(comm.all_reduce(input_, group, async_op=True))
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        grad = comm.all_gather(grad_output, ctx.group, dim=0) if ctx.scatter else grad_output
        return grad, None, None, None


class _FinishReduction(torch.autograd.Function):
    """Wait for the reduction :class:`_StartReduction` launched; identity otherwise."""

    @staticmethod
    def forward(ctx, input_, handles):
        for handle in handles:
            handle.wait()
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        return comm.all_to_all(input_, group, output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        grad = comm.all_to_all(grad_output, ctx.group, output_split_sizes=ctx.input_split_sizes,
                               input_split_sizes=ctx.output_split_sizes)
        return grad, None, None, None


def _single(group) -> bool:
    return comm.group_size(group) == 1


def _sizes(sizes):
    """Unequal per-rank sizes as a list, else None (the equal split's path)."""
    return None if sizes is None or len(set(sizes)) <= 1 else list(sizes)


def copy_to_tensor_model_parallel_region(input_, group=None, *, inplace_grad=False):
    """f: forward identity, backward all-reduce over TP.

    ``inplace_grad=True`` sums the incoming gradient in place instead of a copy: for an output
    whose consumer hands backward a fresh gradient nothing else reads, such as a linear layer's
    input gradient.
    """
    group = resolve_tp_group(group)
    return input_ if _single(group) else _CopyToRegion.apply(input_, group, inplace_grad)


def reduce_from_tensor_model_parallel_region(input_, group=None, *, inplace=False):
    """g: forward all-reduce over TP, backward identity.

    ``inplace=True`` sums into ``input_`` itself instead of a copy: for a tensor nothing else
    reads, such as a row-parallel layer's fresh partial output.
    """
    group = resolve_tp_group(group)
    return input_ if _single(group) else _ReduceFromRegion.apply(input_, group, inplace)


def start_reduction_from_tensor_model_parallel_region(input_, group=None, *, sequence_parallel=False,
                                                     then=None) -> comm.Handle:
    """g (or under ``sequence_parallel`` the reduce-scatter of the sequence) without waiting.

    Sums ``input_`` (a fresh partial result nothing else reads) in place; compute on other data
    while it is in flight, then ``.wait()`` for the result (``then(result)`` if given).
    For interleaving independent work, e.g. the two halves of a micro-batch (Domino).

    Example::

        pending = start_reduction_from_tensor_model_parallel_region(partial_a)
        other = compute(b)                       # runs while partial_a is all-reduced
        a = pending.wait()
    """
    group = resolve_tp_group(group)
    if _single(group):
        return comm.Handle(None, input_, then)
    handles: list = []
    started = _StartReduction.apply(input_, group, sequence_parallel, handles)

    def finish(output):
        reduced = _FinishReduction.apply(output, handles)
        return reduced if then is None else then(reduced)

    return comm.Handle(None, started, finish)


def scatter_to_tensor_model_parallel_region(input_, group=None, *, sizes=None):
    """Keep this rank's slice of the last dim; backward all-gathers the last dim.

    ``sizes`` (one per rank; default equal) gives every mapping here slices of unequal size.
    """
    group = resolve_tp_group(group)
    return input_ if _single(group) else _SplitRegion.apply(input_, group, -1, _sizes(sizes))


def gather_from_tensor_model_parallel_region(input_, group=None, *, sizes=None):
    """All-gather the last dim; backward keeps this rank's slice."""
    group = resolve_tp_group(group)
    return input_ if _single(group) else _GatherRegion.apply(input_, group, -1, False, _sizes(sizes))


def scatter_to_sequence_parallel_region(input_, group=None, *, sizes=None):
    """Keep this rank's slice of the sequence (dim 0); backward all-gathers it."""
    group = resolve_tp_group(group)
    return input_ if _single(group) else _SplitRegion.apply(input_, group, 0, _sizes(sizes))


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None, *, sizes=None):
    """All-gather the sequence (dim 0); Megatron's positional order, so ported calls work.

    Backward reduce-scatters when the consumer is TP-parallel (each rank holds a partial
    gradient of the whole sequence), and just keeps this rank's slice when it is not.
    """
    if isinstance(tensor_parallel_output_grad, dist.ProcessGroup):
        warnings.warn("gather_from_sequence_parallel_region(input_, group) is deprecated: the second "
                      "positional argument is tensor_parallel_output_grad (Megatron's order); pass group=",
                      FutureWarning, stacklevel=2)
        tensor_parallel_output_grad, group = True, tensor_parallel_output_grad
    group = resolve_tp_group(group)
    if _single(group):
        return input_
    return _GatherRegion.apply(input_, group, 0, tensor_parallel_output_grad, _sizes(sizes))


def reduce_scatter_to_sequence_parallel_region(input_, group=None, *, sizes=None):
    """Sum partial results over TP and keep this rank's sequence slice; backward all-gathers."""
    group = resolve_tp_group(group)
    return input_ if _single(group) else _ReduceScatterRegion.apply(input_, group, 0, _sizes(sizes))


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None, *, sizes=None):
    """All-gather the last dim; backward reduce-scatters it."""
    group = resolve_tp_group(group)
    return input_ if _single(group) else _GatherRegion.apply(input_, group, -1, True, _sizes(sizes))


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None, *, sizes=None):
    """Reduce-scatter the last dim; backward all-gathers it."""
    group = resolve_tp_group(group)
    return input_ if _single(group) else _ReduceScatterRegion.apply(input_, group, -1, _sizes(sizes))


class _SumOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient rows that several ranks hold."""

    @staticmethod
    def forward(ctx, input_, group, local_rows, shared_rows, num_shared):
        ctx.group, ctx.local_rows, ctx.shared_rows, ctx.num_shared = group, local_rows, shared_rows, num_shared
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        local_rows = ctx.local_rows.to(grad_output.device)
        shared_rows = ctx.shared_rows.to(grad_output.device)
        shared = grad_output.new_zeros((ctx.num_shared, *grad_output.shape[1:]))
        shared.index_copy_(0, shared_rows, grad_output.index_select(0, local_rows))
        comm.all_reduce(shared, ctx.group)
        return grad_output.index_copy(0, local_rows, shared.index_select(0, shared_rows)), None, None, None, None


def sum_grad_over_replicas(input_, group=None, *, local_rows, shared_rows, num_shared):
    """Identity forward; backward sums over ``group`` the gradient rows held by several ranks.

    For a parameter some of whose rows (dim 0) are replicated on several ranks, each of which
    computes a partial gradient: ``local_rows[i]`` (this rank's row) is shared row
    ``shared_rows[i]`` of ``num_shared``. One all-reduce of ``[num_shared, ...]``, in which a
    rank's rows it does not hold are zero, so each shared row is summed over exactly its holders.

    Example::

        w = sum_grad_over_replicas(self.weight, local_rows=torch.tensor([4, 5]),
                                   shared_rows=torch.tensor([0, 1]), num_shared=2)
    """
    group = resolve_tp_group(group)
    if _single(group) or num_shared == 0:
        return input_
    return _SumOverReplicas.apply(input_, group, local_rows, shared_rows, num_shared)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, *, output_split_sizes=None):
    """All-to-all over dim 0 (Megatron's arguments and spelling); backward is the reverse exchange.

    ``output_split_sizes=`` is tensorpar 0.2's spelling, deprecated.
    """
    if output_split_sizes is not None:
        warnings.warn("all_to_all(output_split_sizes=) is deprecated: Megatron's spelling is "
                      "output_split_sizes_", DeprecationWarning, stacklevel=2)
        output_split_sizes_ = output_split_sizes
    group = resolve_tp_group(group)
    if _single(group):
        return input_
    return _AllToAll.apply(input_, group, output_split_sizes_, input_split_sizes)


def _switch_split(input_, group, *, to_hidden: bool):
    """``input_`` as ``[tokens, hidden]`` re-split over TP from tokens to hidden (or back)."""
    group = resolve_tp_group(group)
    n = comm.group_size(group)
    if n == 1:
        return input_
    hidden = input_.shape[-1]
    input_ = input_.reshape(-1, hidden)
    if to_hidden:
        comm.check_divisible(hidden, n, "all_to_all_sp2hp hidden size")
        # Rank i must receive the i-th hidden slice of every rank's tokens.
        return all_to_all(group, torch.cat(input_.split(hidden // n, dim=1), dim=0))
    comm.check_divisible(input_.shape[0], n, "all_to_all_hp2sp token count")
    received = all_to_all(group, input_)
    return torch.cat(received.split(input_.shape[0] // n, dim=0), dim=1)


def all_to_all_sp2hp(input_, group=None):
    """``[tokens/TP, H]`` (sequence-parallel) -> ``[tokens, H/TP]`` (hidden-parallel)."""
    return _switch_split(input_, group, to_hidden=True)


def all_to_all_hp2sp(input_, group=None):
    """``[tokens, H/TP]`` (hidden-parallel) -> ``[tokens/TP, H]`` (sequence-parallel)."""
    return _switch_split(input_, group, to_hidden=False)
