"""TP-invariant mode: every floating-point sum in an order, every GEMM in a shape, that does not
depend on the TP size, so training at every TP size gives the same bits (``GPTConfig(tp_invariant=True)``).

Each TP-split dimension is cut into ``blocks`` fixed blocks (``BLOCKS`` = 8, or 24 for TP 3 and
6: ``GPTConfig.invariant_blocks``); at TP = t a rank owns ``blocks / t`` of every stride piece.

* GEMMs run one block at a time, each with the shape it has at TP = 1. A sum over blocks (the
  row layer's partial outputs, the column layer's input grad) is one tree over the blocks
  (:func:`~tensorpar.distributed.tree_reduce.tree_sum`): a rank sums its blocks as subtrees of it (one
  at TP 1, 2, 4, 8), and the cross-rank step finishes the same tree.
* A cross-rank sum is an all-to-all of the partial sums plus the same tree on each rank's
  slice (the bytes of a ring reduce-scatter), then an all-gather where every rank needs the
  whole sum (the bytes of a ring all-reduce). Over two ranks in fp32/fp64 the tree's last step
  is one IEEE add, the same in either order: the backend's own reduce-scatter or all-reduce.
* Every block GEMM's operands are contiguous, of the same shape at every TP size.
* Norm weights' grads are summed over fixed sequence blocks, the vocab-parallel softmax's
  normaliser over fixed vocab blocks, the grad norm over the same weight blocks.

Example::

    model = GPT(GPTConfig.preset("tiny", tp_invariant=True))     # the same bits at any TP size
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from ..data_parallel import grads as grads_module
from ..tensor_parallel.cross_entropy import _check_targets, _VocabParallelCrossEntropy
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.linear_function import compute_dtype_of
from ..tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from ..distributed.tree_reduce import (
    BLOCKS, all_reduce_subtrees, all_reduce_tree, reduce_scatter_subtrees, sequence_sum, subtree_sums, tree_sum)

def _check_blocks(size: int, stride: int, what: str, blocks: int) -> None:
    """Refuse a dimension of ``size`` (``stride`` pieces) that ``blocks`` blocks per piece do not divide."""
    if size % (stride * blocks):
        raise ValueError(f"tp_invariant: {what} ({size}) is not divisible by {stride * blocks} "
                         f"({blocks} fixed blocks" + (f" x stride {stride})" if stride > 1 else ")"))


def _over_tp(sums, group, blocks: int, sequence_parallel: bool, *, async_op: bool = False):
    """The tree over all ``blocks`` of a sum each rank of ``group`` holds ``sums`` of (its
    :func:`subtree_sums`): scattered along the sequence under SP, else whole on every rank."""
    if sequence_parallel:
        return reduce_scatter_subtrees(sums, group, leaves=blocks, dim=0, async_op=async_op)
    return all_reduce_subtrees(sums, group, leaves=blocks, async_op=async_op)


def _grouped(t: torch.Tensor, stride: int, groups: int) -> torch.Tensor:
    """Local rows ``[stride pieces x groups x rows]`` regrouped as ``[groups, stride x rows, ...]``,
    contiguous: group ``i`` holds block ``i`` of every piece (the same GEMM at every TP size)."""
    rest = t.shape[1:]
    return t.reshape(stride, groups, -1, *rest).transpose(0, 1).reshape(groups, -1, *rest).contiguous()


def _merged(parts, stride: int, dim: int) -> torch.Tensor:
    """Per-group results (``stride x rows`` along ``dim``) in this rank's order ``stride x groups
    x rows`` along ``dim``: the inverse of :func:`_grouped`, in one copy."""
    return torch.stack([p.unflatten(dim, (stride, -1)) for p in parts], dim=dim + 1).flatten(dim, dim + 2)


def _k_blocks(t2d: torch.Tensor, blocks: int) -> torch.Tensor:
    """The column blocks of ``t2d`` as one contiguous ``[blocks, rows, columns / blocks]`` tensor."""
    return t2d.view(t2d.shape[0], blocks, -1).transpose(0, 1).contiguous()


def _row_blocks(t2d: torch.Tensor, cp_group, blocks: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows (sequence-major) in its ``blocks / CP`` fixed sequence blocks, each contiguous."""
    mine = blocks // (1 if cp_group is None else comm.group_size(cp_group))
    if t2d.shape[0] % mine:
        raise ValueError(f"tp_invariant: this rank's {t2d.shape[0]} rows are not {mine} equal sequence blocks "
                         f"(the sequence length must divide by {blocks})")
    return t2d.chunk(mine)


def _rows_sum(parts_of_block, g2d: torch.Tensor, x2d: torch.Tensor | None, cp_group, blocks: int) -> torch.Tensor:
    """A sum over rows (a weight or bias grad) at every CP size in one tree: ``parts_of_block(g, x)``
    of each fixed sequence block (the GEMM of the shape it has at CP = 1), :func:`sequence_sum`, then
    :func:`all_reduce_tree` over ``cp_group``, in backward (after gradient accumulation the
    micro-batches' partial sums would be added in another order than at CP = 1)."""
    gs = _row_blocks(g2d, cp_group, blocks)
    xs = [None] * len(gs) if x2d is None else _row_blocks(x2d, cp_group, blocks)
    return sequence_sum(parts_of_block(g, x) for g, x in zip(gs, xs))


def _over_context(tensor: torch.Tensor, cp_group) -> torch.Tensor:
    """``tensor`` (a rank's subtree of a sum over the sequence) summed over ``cp_group`` (None: as is)."""
    return tensor if cp_group is None else all_reduce_tree(tensor, cp_group)


def _wgrad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return g.t().matmul(x)


def _bias_grad(g: torch.Tensor, _) -> torch.Tensor:
    return g.sum(dim=0)


class _Column(torch.autograd.Function):
    """``x W^T + b`` by fixed column groups; dgrad summed over the groups (and ranks) in a tree.

    ``shared = (rows, stride)``: the weight's last ``rows`` (``stride`` pieces) are whole on every
    rank, their output grads too. Their GEMMs, dgrad tree and weight grads are TP = 1's on each
    rank; their dgrad is added to the split rows' once that is summed over the ranks (at TP = 1 too)."""

    @staticmethod
    def forward(ctx, input_, weight, bias, stride, sequence_parallel, group, cp_group, blocks, shared):
        dtype = compute_dtype_of(input_)
        input_ = input_.to(dtype)
        total = comm.all_gather(input_, group, dim=0) if sequence_parallel else input_
        x2d = total.reshape(-1, total.shape[-1])
        split = weight.shape[0] - shared[0]
        # (rows, stride pieces, groups): the split rows' groups are this rank's blocks, the shared rows' all of them.
        layouts = [(slice(0, split), stride, blocks // comm.group_size(group))]
        if shared[0]:
            layouts.append((slice(split, None), shared[1], blocks))
        weights = [_grouped(weight[rows].to(dtype), pieces, groups) for rows, pieces, groups in layouts]
        biases = [[None] * groups if bias is None else _grouped(bias[rows].to(dtype), pieces, groups)
                  for rows, pieces, groups in layouts]
        with torch.autocast(input_.device.type, enabled=False):
            outputs = [_merged([F.linear(x2d, w, b) for w, b in zip(ws, bs)], pieces, 1)
                       for ws, bs, (_, pieces, _) in zip(weights, biases, layouts)]
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        ctx.save_for_backward(input_, *weights)
        ctx.sequence_parallel, ctx.group, ctx.has_bias, ctx.layouts = sequence_parallel, group, bias is not None, layouts
        ctx.weight_dtype, ctx.cp_group, ctx.blocks = weight.dtype, cp_group, blocks
        return output.view(*total.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output):
        input_, *weights = ctx.saved_tensors
        group, n = ctx.group, comm.group_size(ctx.group)
        # As Megatron's column layer: the SP input gathers during the dgrad GEMMs, and the dgrad
        # sum travels during the wgrad GEMMs.
        gathering = comm.all_gather(input_, group, dim=0, async_op=True) if ctx.sequence_parallel else None
        shape = [input_.shape[0] * (n if ctx.sequence_parallel else 1), *input_.shape[1:]]
        rows = math.prod(shape[:-1])
        g2d = grad_output.reshape(rows, -1)
        g_groups = []
        for (columns, pieces, groups), ws in zip(ctx.layouts, weights):
            grads = g2d[:, columns].reshape(rows, pieces, groups, -1).to(ws.dtype)
            g_groups.append([grads[:, :, i].contiguous().view(rows, -1) for i in range(groups)])
        first = comm.group_rank(group) * ctx.layouts[0][2]
        sums = [s.view(shape) for s in subtree_sums([g.matmul(w) for g, w in zip(g_groups[0], weights[0])],
                                                     first=first, leaves=ctx.blocks)]
        grad_input = _over_tp(sums, group, ctx.blocks, ctx.sequence_parallel, async_op=True)
        shared_input = None
        if len(weights) > 1:  # whole on every rank: this rank's rows of it under SP
            shared_input = tree_sum([g.matmul(w) for g, w in zip(g_groups[1], weights[1])]).view(shape)
            shared_input = shared_input.chunk(n)[comm.group_rank(group)] if ctx.sequence_parallel else shared_input
        total = gathering.wait() if gathering is not None else input_
        x2d = total.reshape(rows, total.shape[-1])
        cp = ctx.cp_group

        def summed(part, x):
            merged = [_merged([_rows_sum(part, g, x, cp, ctx.blocks) for g in gs], pieces, 0)
                      for gs, (_, pieces, _) in zip(g_groups, ctx.layouts)]
            return _over_context(merged[0] if len(merged) == 1 else torch.cat(merged), cp)

        grad_weight = summed(_wgrad, x2d)
        grad_bias = summed(_bias_grad, None) if ctx.has_bias else None
        grad_input = grad_input.wait()
        if shared_input is not None:
            grad_input = grad_input + shared_input
        return grad_input, grad_weight.to(ctx.weight_dtype), grad_bias, None, None, None, None, None, None


class _Row(torch.autograd.Function):
    """``x A + b`` by fixed K blocks summed in a tree, across ranks too; the bias grad from the
    whole (gathered) output grad, so it is complete on every rank."""

    @staticmethod
    def forward(ctx, input_, weight, bias, sequence_parallel, group, cp_group, blocks):
        dtype = compute_dtype_of(input_)
        input_ = input_.to(dtype)
        mine = blocks // comm.group_size(group)
        xs = _k_blocks(input_.reshape(-1, input_.shape[-1]), mine)
        ws = _k_blocks(weight.to(dtype), mine)
        with torch.autocast(input_.device.type, enabled=False):
            sums = subtree_sums([F.linear(x, w) for x, w in zip(xs, ws)], first=comm.group_rank(group) * mine,
                                leaves=blocks)
        output = _over_tp([s.view(*input_.shape[:-1], -1) for s in sums], group, blocks, sequence_parallel)
        if bias is not None:
            output = output.add_(bias.to(dtype))  # a temporary of this function
        ctx.save_for_backward(xs, ws)
        ctx.sequence_parallel, ctx.group, ctx.has_bias = sequence_parallel, group, bias is not None
        ctx.weight_dtype, ctx.input_shape, ctx.cp_group, ctx.blocks = weight.dtype, input_.shape, cp_group, blocks
        return output

    @staticmethod
    def backward(ctx, grad_output):
        xs, ws = ctx.saved_tensors
        if ctx.sequence_parallel:
            grad_output = comm.all_gather(grad_output.contiguous(), ctx.group, dim=0)
        # Whole rows at every TP size: the same [M, N] operand (and its transpose) everywhere.
        g2d = grad_output.reshape(-1, grad_output.shape[-1]).to(ws.dtype).contiguous()
        grad_input = torch.cat([g2d.matmul(w) for w in ws], dim=1).view(ctx.input_shape)
        cp = ctx.cp_group
        grad_weight = _over_context(torch.cat([_rows_sum(_wgrad, g2d, x, cp, ctx.blocks) for x in xs], dim=1), cp)
        grad_bias = _over_context(_rows_sum(_bias_grad, g2d, None, cp, ctx.blocks), cp) if ctx.has_bias else None
        return grad_input, grad_weight.to(ctx.weight_dtype), grad_bias, None, None, None, None


class _KVForQueryHeads(torch.autograd.Function):
    """Every K/V head (``[b, groups, s, d]``) once per query head of this rank; backward: each K/V
    head's grads summed over its query heads in order, whole on every rank."""

    @staticmethod
    def forward(ctx, k, v, first_head, local_heads, queries_per_group, group):
        ctx.p, ctx.group = queries_per_group, group
        # Whole groups on this rank (and so on every rank): each sums its own, then the sums travel.
        ctx.whole_groups = first_head % queries_per_group == 0 and local_heads % queries_per_group == 0
        reads = torch.arange(first_head, first_head + local_heads, device=k.device) // queries_per_group
        return k.index_select(1, reads), v.index_select(1, reads)

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        grads = torch.stack([grad_k, grad_v])  # [2, b, heads here, s, d]
        if not ctx.whole_groups:  # a group's query heads on several ranks: all of them here first
            grads = comm.all_gather(grads.contiguous(), ctx.group, dim=2)
        per_group = grads.unflatten(2, (-1, ctx.p))
        summed = per_group[:, :, :, 0]
        for j in range(1, ctx.p):  # in query-head order, as at TP = 1, on every device
            summed = summed + per_group[:, :, :, j]
        if ctx.whole_groups:
            summed = comm.all_gather(summed.contiguous(), ctx.group, dim=2)
        return summed[0], summed[1], None, None, None, None


def kv_for_query_heads(k: torch.Tensor, v: torch.Tensor, *, first_head: int, local_heads: int,
                       queries_per_group: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention's K/V heads (all of them, ``[b, groups, s, d]``, on every rank of
    ``group``) once per query head ``first_head, ..`` of this rank (query head ``h`` reads K/V
    head ``h // queries_per_group``): attention without ``enable_gqa``, whose kernel sums a K/V
    head's grads over its query heads in an order of its own.

    Backward sums each K/V head's grads over its query heads in query-head order, the whole
    K/V grads of TP = 1 on every rank, wherever its query heads are, and at any CP size (the sum
    is per position): where each rank's query heads are whole groups, each sums its own and one
    all-gather brings the sums; else (6 heads, 2 K/V heads at TP 3: head 2 on rank 1, heads 0 and
    1 on rank 0) one all-gather brings every query head's grads and every rank sums them all.

    Example::

        k, v = kv_for_query_heads(k, v, first_head=2, local_heads=2, queries_per_group=3, group=tp_group)
    """
    return _KVForQueryHeads.apply(k, v, first_head, local_heads, queries_per_group, group)


def check_gpt_sizes(config, *, tp_size: int, seq_len: int | None = None) -> None:
    """Refuse (ValueError naming the values) a GPT config whose TP-split sizes or sequence length
    the fixed blocks do not divide, or a TP size that does not divide its ``invariant_blocks``."""
    blocks = config.invariant_blocks
    if blocks % tp_size:
        raise ValueError(f"the tensor-parallel size {tp_size} does not divide the {blocks} fixed blocks "
                         f"(they serve TP {', '.join(str(d) for d in range(1, blocks + 1) if blocks % d == 0)}; "
                         "invariant_blocks (--invariant-blocks) 24 serves 1, 2, 3, 4, 6, 8)")
    if config.num_heads % tp_size:
        raise ValueError(f"num_heads {config.num_heads} at the tensor-parallel size {tp_size}: tp_invariant needs "
                         "the query heads divisible by TP (grouped K/V heads need not be: every rank holds them all)")
    widths = {"hidden_size": config.hidden_size,
              "num_query_groups x head_dim": config.num_query_groups * config.head_dim,
              "ffn_hidden_size": config.ffn_hidden_size,
              "moe_shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size or 0,
              "the padded vocabulary": config.padded_vocab_size(tp_size)}
    bad = [f"{name} {value}" for name, value in widths.items() if value % blocks]
    wrong = [f"{', '.join(bad)} not divisible by the {blocks} fixed blocks of tp_invariant"] if bad else []
    if seq_len is not None and seq_len % blocks:
        wrong.append(f"the sequence length {seq_len} not divisible by the {blocks} fixed sequence blocks")
    if wrong:
        raise ValueError("; ".join(wrong))


def check_layer(layer: nn.Module) -> None:
    """Refuse what the invariant layers do not do, naming it."""
    name = type(layer).__name__
    if layer.blocks % layer.tp_size:
        raise ValueError(f"tp_invariant: the tensor-parallel size {layer.tp_size} must divide the {layer.blocks} "
                         "fixed blocks")
    if layer.gradient_accumulation_fusion:
        raise ValueError(f"{name}: tp_invariant does not support gradient_accumulation_fusion")
    if layer.overlap not in ("off", 1):
        raise ValueError(f"{name}: tp_invariant does not support overlap={layer.overlap!r}")
    if layer.is_expert:
        raise ValueError(f"{name}: tp_invariant does not support is_expert=True")


class ColumnLinear(ColumnParallelLinear):
    """:class:`~tensorpar.ColumnParallelLinear` whose GEMMs and sums do not depend on the TP size.

    Needs ``output_size`` divisible by ``blocks x stride``; no overlap, gradient-accumulation
    fusion or deferred wgrads. ``blocks``: the fixed blocks of each stride piece (``BLOCKS``;
    a TP size must divide them: 24 serves TP 3 and 6 too). ``cp_group``: the context-parallel
    group whose ranks hold other rows of the sequence (the weight grads are summed over it in
    backward). ``shared_rows``: the weight's last rows, in ``shared_stride`` pieces, every rank
    holds and computes whole (``partition_rows`` saying so: grouped-query attention's K/V heads),
    their output grads whole on every rank too; the rows before them are then one piece split
    over TP, ``stride`` naming the whole weight's layout for checkpoints only.

    Example::

        fc1 = ColumnLinear(64, 256, blocks=24, tp_group=group)     # the same bits at TP 1, 2, 3, 4, 6, 8
    """

    def __init__(self, input_size, output_size, *, cp_group=None, blocks: int = BLOCKS, shared_rows: int = 0,
                 shared_stride: int = 1, **kwargs) -> None:
        self.blocks = blocks
        super().__init__(input_size, output_size, **kwargs)
        # The layer's, not read off the weight: FSDP's unsharded parameters, which forward and
        # backward see, carry no partition_stride (stride 1 would regroup the GEMMs: other bits).
        self.cp_group, self.shared = cp_group, (shared_rows, shared_stride)
        self.stride = 1 if shared_rows else kwargs.get("stride", 1)
        grads_module.mark_tp_invariant(self.parameters(), blocks=blocks)  # the gradient helpers sum them in order
        check_layer(self)
        if self.defer_wgrad_compute:
            raise ValueError("ColumnLinear: tp_invariant does not support defer_wgrad_compute=True")
        split = output_size - shared_rows
        if (self.weight_shape[0] - shared_rows) * self.tp_size != split:
            raise ValueError(f"ColumnLinear: tp_invariant does not support uneven partitions "
                             f"({self.weight_shape[0]} of {output_size} rows on this rank, {shared_rows} on each)")
        if shared_rows and self.gather_output:
            raise ValueError("ColumnLinear: tp_invariant does not support gather_output=True with shared_rows")
        if shared_rows:
            for param in self.parameters():
                param.tp_shared_rows = shared_rows  # the grad norm counts them once, as a replicated tensor's
        _check_blocks(split, self.stride, "ColumnParallelLinear output_size" + (" less its shared rows" if shared_rows
                                                                                else ""), blocks)
        _check_blocks(shared_rows, shared_stride, "ColumnParallelLinear shared_rows", blocks)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        _check_blocks((weight.shape[0] - self.shared[0]) * self.tp_size, self.stride, "the column weight's rows",
                      self.blocks)
        bias = None if self.skip_bias_add else self.bias
        output = _Column.apply(input_, weight, bias, self.stride, self.sequence_parallel, self.tp_group,
                               self.cp_group, self.blocks, self.shared)
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class RowLinear(RowParallelLinear):
    """:class:`~tensorpar.RowParallelLinear` whose GEMMs and sums do not depend on the TP size.

    Needs ``input_is_parallel=True`` and ``input_size`` divisible by ``blocks``. Under SP its
    bias grad is whole on every rank (not marked ``sequence_parallel``); ``cp_group`` and
    ``blocks`` as :class:`ColumnLinear`'s. Where a rank's blocks are not one subtree of the
    blocks' tree (TP 3 of 24), the ranks exchange each subtree's partial output: up to 4x the
    bytes.
    """

    def __init__(self, input_size, output_size, *, cp_group=None, blocks: int = BLOCKS, **kwargs) -> None:
        self.blocks = blocks
        super().__init__(input_size, output_size, **kwargs)
        self.cp_group = cp_group
        grads_module.mark_tp_invariant(self.parameters(), blocks=blocks)  # the gradient helpers sum them in order
        check_layer(self)
        if not self.input_is_parallel:
            raise ValueError("RowLinear: tp_invariant needs input_is_parallel=True")
        if self.weight_shape[1] * self.tp_size != input_size:
            raise ValueError(f"RowLinear: tp_invariant does not support uneven partitions "
                             f"({self.weight_shape[1]} of {input_size} columns on this rank)")
        _check_blocks(input_size, 1, "RowParallelLinear input_size", blocks)
        if self.bias is not None:
            self.bias.sequence_parallel = False

    def forward(self, input_):
        bias = None if self.skip_bias_add else self.bias
        output = _Row.apply(input_, self.weight, bias, self.sequence_parallel, self.tp_group, self.cp_group,
                            self.blocks)
        return output, (self.bias if self.skip_bias_add else None)

    def start(self, input_):
        raise ValueError("RowLinear: tp_invariant does not support interleave (Domino)")


def sequence_blocks_sum(parts: torch.Tensor, group, cp_group) -> torch.Tensor:
    """The sum over a sequence's fixed blocks of ``parts`` (``[this rank's blocks, ...]``, each
    block's partial sum, in its order) in the sequence's tree, whole on every rank: gathered
    over ``group`` where its ranks hold runs of the sequence (SP: a run is not a subtree of the
    tree), then :func:`sequence_sum` and the CP ranks' subtrees finished over ``cp_group``."""
    if group is not None:  # [blocks of every TP rank, ...], in sequence order
        parts = comm.all_gather(parts.contiguous(), group, dim=0)
    return _over_context(sequence_sum(parts.unbind(0)), cp_group)


class BlockRowsLinear(torch.autograd.Function):
    """``x W^T`` of rows ``x`` ``[T, h]`` (this rank's ``blocks`` fixed sequence blocks, in order)
    by a weight every rank holds whole; its grad is the per-block ``g^T x`` summed by
    :func:`sequence_blocks_sum` over ``group`` (the ranks the tokens are split over) and
    ``cp_group`` in backward: a router's weight in the invariant mode.

    Example::

        logits = BlockRowsLinear.apply(tokens, router_weight, 4, tp_group, cp_group)
    """

    @staticmethod
    def forward(ctx, x, weight, blocks, group, cp_group):
        dtype = compute_dtype_of(x)
        x, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, w)
        ctx.blocks, ctx.group, ctx.cp_group, ctx.weight_dtype = blocks, group, cp_group, weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.to(w.dtype)
        if x.shape[0] % ctx.blocks:
            raise ValueError(f"tp_invariant: this rank's {x.shape[0]} tokens are not {ctx.blocks} equal "
                             "sequence blocks")
        parts = torch.stack([_wgrad(g, xb) for g, xb in zip(grad.chunk(ctx.blocks), x.chunk(ctx.blocks))])
        grad_weight = sequence_blocks_sum(parts, ctx.group, ctx.cp_group)
        return grad.matmul(w), grad_weight.to(ctx.weight_dtype), None, None, None


class _BlockAffine(torch.autograd.Function):
    """``x_hat * weight (+ bias)``; the parameters' grads summed over ``blocks`` fixed row blocks
    (dim 0, the sequence) in the sequence's tree (:func:`sequence_sum`), in backward: summed after
    gradient accumulation instead, the micro-batches' partial sums would be added in another order
    than at TP = 1 and CP = 1. Under SP (``group``) the TP ranks' blocks are gathered first (each
    TP rank's is a run of the sequence, not a subtree of its tree); under CP (``cp_group``) each
    CP rank's sum is a subtree, finished over the CP ranks."""

    @staticmethod
    def forward(ctx, x_hat, weight, bias, blocks, group, cp_group):
        ctx.save_for_backward(x_hat, weight)
        ctx.blocks, ctx.has_bias, ctx.group, ctx.cp_group = blocks, bias is not None, group, cp_group
        output = x_hat * weight
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx, grad_output):
        x_hat, weight = ctx.saved_tensors
        width = grad_output.shape[-1]
        grads = [g.reshape(-1, width) for g in grad_output.chunk(ctx.blocks, dim=0)]
        inputs = [x.reshape(-1, width) for x in x_hat.chunk(ctx.blocks, dim=0)]
        parts = torch.stack([torch.stack([(g * x).sum(dim=0)] + ([g.sum(dim=0)] if ctx.has_bias else []))
                             for g, x in zip(grads, inputs)])
        summed = sequence_blocks_sum(parts, ctx.group, ctx.cp_group)
        grad_bias = summed[1] if ctx.has_bias else None
        return grad_output * weight, summed[0].to(weight.dtype), grad_bias, None, None, None


class _NormBlocks:
    """Normalise without the affine, then :class:`_BlockAffine` over ``row_blocks`` sequence blocks."""

    def _affine(self, x_hat: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x_hat.shape[0] % self.row_blocks:
            raise ValueError(f"tp_invariant: this rank's sequence length {x_hat.shape[0]} is not divisible by "
                             f"its {self.row_blocks} fixed sequence blocks")
        return _BlockAffine.apply(x_hat, self.weight, self.bias, self.row_blocks, self.tp_group, self.cp_group)


class LayerNorm(_NormBlocks, nn.LayerNorm):
    """``nn.LayerNorm`` whose weight and bias grads are summed over ``row_blocks`` fixed sequence
    blocks, and over ``tp_group`` (SP: this rank holds a slice of the sequence) and ``cp_group``
    (CP: this rank holds two chunks of it) in backward."""

    def __init__(self, *args, row_blocks: int, tp_group=None, cp_group=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        grads_module.mark_tp_invariant(self.parameters())  # the gradient helpers sum them in order
        self.row_blocks, self.tp_group, self.cp_group = row_blocks, tp_group, cp_group

    def forward(self, x):
        return self._affine(F.layer_norm(x, self.normalized_shape, None, None, self.eps))


class RMSNorm(_NormBlocks, nn.RMSNorm):
    """``nn.RMSNorm`` whose weight grad is summed as :class:`LayerNorm`'s."""

    bias = None

    def __init__(self, *args, row_blocks: int, tp_group=None, cp_group=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        grads_module.mark_tp_invariant(self.parameters())  # the gradient helpers sum them in order
        self.row_blocks, self.tp_group, self.cp_group = row_blocks, tp_group, cp_group

    def forward(self, x):
        return self._affine(F.rms_norm(x, self.normalized_shape, None, self.eps))


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_size: int,
                                 tp_group, ignore_index: int = -100, blocks: int = BLOCKS) -> torch.Tensor:
    """:func:`tensorpar.vocab_parallel_cross_entropy` (no label smoothing) with the softmax
    normaliser summed over ``blocks`` fixed vocab blocks, across ranks in the same tree."""
    tp_size = comm.group_size(tp_group)
    if blocks % tp_size:
        raise ValueError(f"tp_invariant: the tensor-parallel size {tp_size} must divide the {blocks} fixed blocks")
    padded = logits.shape[-1] * tp_size
    _check_blocks(padded, 1, "the padded vocabulary", blocks)
    block, mine = padded // blocks, blocks // tp_size
    _check_targets(target, ignore_index, vocab_size)

    def sum_stats(exp, stats):
        # Each block's sum over its own contiguous run of a row (no copy of ``exp``), the blocks
        # then added in the tree; the other stats (one rank's nonzero) ride with the first subtree.
        block_sums = exp.unflatten(-1, (-1, block)).sum(dim=-1)
        sums = subtree_sums(block_sums.unbind(dim=-1), first=comm.group_rank(tp_group) * mine, leaves=blocks)
        nodes = [torch.stack([node, *(stats if i == 0 else map(torch.zeros_like, stats))])
                 for i, node in enumerate(sums)]
        return all_reduce_subtrees(nodes, tp_group, leaves=blocks)

    return _VocabParallelCrossEntropy.apply(logits, target, 0.0, ignore_index, tp_group, vocab_size, sum_stats)
