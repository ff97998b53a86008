"""The invariant mode's mixture-of-experts layer: the same bits at every TP, CP, DP and EP size.

The default layer (:class:`tensorpar.expert_parallel.MoELayer`) multiplies whatever rows reach
an expert's rank in one GEMM, so the layout decides which rows meet. Here an expert computes
one *leaf* at a time: the rows of one micro-batch's one fixed sequence block (``blocks``, the
model's ``invariant_blocks``) routed to it, in token order, the same GEMM at every layout. Its
weight gradient is its leaves' summed in the invariant trees: over a micro-batch's blocks as
every sequence sum (:func:`~tensorpar.distributed.tree_reduce.sequence_sum`), then over the
micro-batches as every other gradient (``DataParallelGradReducer(micro_batches=)``).

Where the rows go: each carries its token's key (which data rank's micro-batch, which place in
it) over the *exchange group*, which holds whole micro-batches.

* EP >= TP x CP: the EP group, over ``EP / (TP x CP)`` data ranks. A rank computes the experts
  it holds, and every backward gives it one micro-batch of each data rank: the first's gradient
  in ``.grad``, the others' in ``other_source_grads`` (``expert_sources`` of them), which the
  reducer sums in a tree apiece and then pairwise
  (:class:`~tensorpar.distributed.tree_reduce.SourceTrees`), as the DP ranks' trees are finished.
* EP < TP x CP: the TP x CP group, whose ranks hold each expert ``TP x CP / EP`` times; they
  split the computing (rank ``g`` of the group computes the ``g // EP``-th slice of the experts it
  holds), the others' gradient of an expert is -0.0, which the sum over expert-DP adds exactly.

Both need the ranks in ``initialize_model_parallel``'s order (TP fastest, then CP, then DP).
The router's weight gradient is summed over the fixed sequence blocks (:class:`BlockRowsLinear`)
and its sigmoid takes one kernel path per element (:func:`~.lanewise.lanewise`).

Example::

    moe = MoELayer(512, blocks=8, num_experts=8, ffn_hidden_size=1024, topk=2, ep_group=ep, tp_group=tp,
                   exchange_group=tp_cp)   # exchange_group: only where EP < TP x CP
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import comm
from ..distributed.tree_reduce import sequence_sum
from ..expert_parallel import MoELayer as _MoELayer
from ..expert_parallel import TopKRouter, combine, dispatch
from ..expert_parallel.dispatch import inverse_permutation
from ..expert_parallel.experts import swiglu
from ..tensor_parallel.linear_function import compute_dtype_of
from .lanewise import lanewise
from .layers import BlockRowsLinear


class Router(TopKRouter):
    """:class:`~tensorpar.expert_parallel.TopKRouter` of the invariant mode: its weight's gradient
    summed over the ``row_blocks`` fixed sequence blocks of this rank's tokens, across
    ``token_group`` (the TP ranks the tokens are split over) and ``context_group``; sigmoid
    through :func:`~.lanewise.lanewise`."""

    def __init__(self, *args, row_blocks: int, token_group, context_group, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.row_blocks, self.token_group, self.context_group = row_blocks, token_group, context_group

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return BlockRowsLinear.apply(tokens, self.weight, self.row_blocks, self.token_group,
                                     self.context_group).float()

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(-1) if self.score_function == "softmax" else lanewise(torch.sigmoid, logits)


class _LeafExperts(torch.autograd.Function):
    """The experts ``first ..`` of ``gate_up``/``down`` on ``rows`` sorted by (expert, source,
    block, token), one GEMM pair per leaf (``leaf_rows``: each leaf's rows, experts x sources x
    blocks); backward sums each expert's leaves' weight gradients per source in the sequence's
    tree, -0.0 for the experts held here and computed elsewhere."""

    @staticmethod
    def forward(ctx, rows, gate_up, down, leaf_rows, first, sources, blocks):
        dtype = compute_dtype_of(rows)
        leaves = sources * blocks  # an expert's
        experts = len(leaf_rows) // leaves
        rows = rows.to(dtype)
        w1 = gate_up[first:first + experts].to(dtype)
        w2 = down[first:first + experts].to(dtype)
        hidden, outs = [], []
        with torch.autocast(rows.device.type, enabled=False):
            for leaf, x in enumerate(rows.split(leaf_rows)):
                h1 = F.linear(x, w1[leaf // leaves])
                hidden.append(h1)
                outs.append(F.linear(swiglu(h1), w2[leaf // leaves]))
        ctx.save_for_backward(rows, torch.cat(hidden), w1, w2)
        ctx.params, ctx.leaf_rows = (gate_up, down), leaf_rows
        ctx.first, ctx.sources, ctx.blocks = first, sources, blocks
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad):
        rows, hidden, w1, w2 = ctx.saved_tensors
        sources, blocks = ctx.sources, ctx.blocks
        grad = grad.to(w1.dtype)
        leaf_grads1, leaf_grads2, grad_rows = [], [], []
        for leaf, (x, h1, dy) in enumerate(zip(rows.split(ctx.leaf_rows), hidden.split(ctx.leaf_rows),
                                               grad.split(ctx.leaf_rows))):
            expert = leaf // (sources * blocks)
            gate, up = h1.chunk(2, dim=-1)
            d_act = dy.matmul(w2[expert])
            leaf_grads2.append(dy.t().matmul(swiglu(h1)))
            d_hidden = torch.cat([torch.ops.aten.silu_backward(d_act * up, gate), d_act * F.silu(gate)], dim=-1)
            leaf_grads1.append(d_hidden.t().matmul(x))
            grad_rows.append(d_hidden.matmul(w1[expert]))
        weight_grads = []
        for param, leaf_grads in zip(ctx.params, (leaf_grads1, leaf_grads2)):
            per_source = [torch.full_like(param, -0.0) for _ in range(sources)]
            for at in range(0, len(leaf_grads), blocks):  # one expert's one source's blocks
                expert, source = divmod(at // blocks, sources)
                per_source[source][ctx.first + expert] = sequence_sum(leaf_grads[at:at + blocks])
            param.other_source_grads = per_source[1:] if sources > 1 else None
            weight_grads.append(per_source[0])
        return torch.cat(grad_rows), *weight_grads, None, None, None, None


class MoELayer(_MoELayer):
    """:class:`tensorpar.expert_parallel.MoELayer` whose output and gradients have the same bits
    at every TP, CP, DP and EP size (see above). ``blocks``: the model's fixed sequence blocks;
    ``exchange_group``: the TP x CP group, needed where EP is smaller than it."""

    router_type = Router

    def __init__(self, hidden_size: int, *, blocks: int, num_experts: int, tp_group=None, cp_group=None,
                 ep_group=None, exchange_group=None, **kwargs) -> None:
        tp, tp_rank = (1, 0) if tp_group is None else (comm.group_size(tp_group), comm.group_rank(tp_group))
        cp, cp_rank = (1, 0) if cp_group is None else (comm.group_size(cp_group), comm.group_rank(cp_group))
        ranks = tp * cp  # the ranks of a micro-batch, each routing its own tokens
        if blocks % ranks:
            raise ValueError(f"tp_invariant with experts: TP x CP = {ranks} does not divide the {blocks} fixed blocks")
        super().__init__(hidden_size, num_experts=num_experts, tp_group=tp_group, cp_group=cp_group,
                         ep_group=ep_group, row_blocks=blocks // ranks, token_group=tp_group if tp > 1 else None,
                         context_group=cp_group if cp > 1 else None, **kwargs)
        self.router.weight.sequence_parallel = False  # summed over the TP ranks' tokens in backward
        self.blocks = blocks
        position = tp_rank + tp * cp_rank
        ep, ep_rank = (1, 0) if ep_group is None else (comm.group_size(ep_group), comm.group_rank(ep_group))
        label = torch.arange(num_experts)
        if ep >= ranks:
            if ep % ranks or ep_rank % ranks != position:
                raise ValueError(f"tp_invariant with experts: the EP group of {ep} must hold whole TP x CP groups "
                                 f"of {ranks} ranks, in order (initialize_model_parallel's default order)")
            self.exchange_group, self.sources, self.slot, self.first = ep_group, ep // ranks, ep_rank // ranks, 0
            self.computed = num_experts // ep
        else:
            if exchange_group is None or comm.group_size(exchange_group) != ranks \
                    or comm.group_rank(exchange_group) != position or ep_rank != position % ep:
                raise ValueError(f"tp_invariant with experts: at EP {ep} below TP x CP = {ranks} the layer needs "
                                 "exchange_group=, the TP x CP group in initialize_model_parallel's order")
            if num_experts % ranks:
                raise ValueError(f"tp_invariant with experts: {num_experts} experts cannot be computed evenly over "
                                 f"TP x CP = {ranks} ranks")
            self.exchange_group, self.sources, self.slot = exchange_group, 1, 0
            held, self.computed = num_experts // ep, num_experts // ranks
            self.first = position // ep * self.computed
            # Expert e (held by EP rank i, the r-th slice there) is computed by group rank r EP + i.
            holder, within = label // held, label % held
            label = (within // self.computed * ep + holder) * self.computed + within % self.computed
        self.register_buffer("label", label.to(self.router.weight.device), persistent=False)
        self.register_buffer("my_blocks", torch.tensor(_blocks_of(blocks, tp=tp, tp_rank=tp_rank, cp=cp,
                                                                  cp_rank=cp_rank), device=self.label.device),
                             persistent=False)
        for param in self.experts.parameters():
            param.expert_sources = self.sources

    def routed(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if len(tokens) % len(self.my_blocks):  # generation's single positions: no leaves to keep
            return super().routed(tokens, weights, experts)
        per_block = len(tokens) // len(self.my_blocks)
        local = torch.arange(len(tokens), device=tokens.device)
        keys = (self.slot * self.blocks + self.my_blocks[local // per_block]) * per_block + local % per_block
        rows, rows_per_expert, routed = dispatch(tokens, self.label[experts], num_experts=self.router.num_experts,
                                                 ep_group=self.exchange_group, keys=keys)
        expert_of_row = torch.repeat_interleave(torch.arange(len(rows_per_expert), device=rows.device),
                                                rows_per_expert)
        leaf_of_row = expert_of_row * (self.sources * self.blocks) + routed.row_keys // per_block
        order = torch.argsort(expert_of_row * (self.sources * self.blocks * per_block) + routed.row_keys)
        leaf_rows = torch.bincount(leaf_of_row, minlength=self.computed * self.sources * self.blocks).tolist()
        out = _LeafExperts.apply(rows.index_select(0, order), self.experts.gate_up, self.experts.down, leaf_rows,
                                 self.first, self.sources, self.blocks)
        return combine(out.index_select(0, inverse_permutation(order)), weights, routed, ep_group=self.exchange_group)


def _blocks_of(blocks: int, *, tp: int, tp_rank: int, cp: int, cp_rank: int) -> list[int]:
    """The fixed sequence blocks of this rank's tokens, in its order: its CP chunks' (``cp_rank``
    and ``2 CP - 1 - cp_rank`` of ``2 CP``), then its TP rank's run of them."""
    if cp > 1:
        per_chunk = blocks // (2 * cp)
        local = [c * per_chunk + i for c in (cp_rank, 2 * cp - 1 - cp_rank) for i in range(per_chunk)]
    else:
        local = list(range(blocks))
    run = len(local) // tp
    return local[tp_rank * run:(tp_rank + 1) * run]
