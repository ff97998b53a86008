"""Gradient bookkeeping after backward that TP layers need from the training loop.

Each helper does what the model's mode needs: parameters of a TP-invariant model carry
``tp_invariant = True`` (set when it is built, :func:`mark_tp_invariant`), and then every sum
over ranks runs in the fixed order of :mod:`tensorpar.distributed.tree_reduce` (the same bits at any TP size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed import comm
from ..tensor_parallel.initialization import param_is_not_tensor_parallel_duplicate
from ..parallel_state import get_data_parallel_group, resolve_tp_group
from ..distributed.tree_reduce import BLOCKS, SourceTrees, all_reduce_subtrees, all_reduce_tree, subtree_sums


def mark_tp_invariant(params, *, blocks: int | None = None) -> None:
    """Mark ``params`` as a TP-invariant model's (what the helpers here read), cut into ``blocks``
    fixed blocks where given (the grad norm sums their squares in those)."""
    for param in params:
        param.tp_invariant = True
        if blocks is not None:
            param.tp_blocks = blocks


def is_tp_invariant(params) -> bool:
    """Whether any of ``params`` belongs to a TP-invariant model (:func:`mark_tp_invariant`)."""
    return any(getattr(p, "tp_invariant", False) for p in params)


def take_source_grads(param: nn.Parameter, grad: torch.Tensor) -> list[torch.Tensor]:
    """``grad``, then the gradients a backward left on ``param`` (``other_source_grads``) for
    the micro-batches of its other sources, taken off it: an expert whose EP group spans
    ``param.expert_sources`` DP ranks gets one micro-batch of each per backward (the invariant
    mode's :class:`tensorpar.invariant.MoELayer`)."""
    others, param.other_source_grads = getattr(param, "other_source_grads", None), None
    return [grad, *(others or [])]


def _main_or_grad(param: nn.Parameter) -> torch.Tensor | None:
    """``main_grad`` where the parameter has one, else ``.grad`` (an FSDP shard's: a DTensor)."""
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def _grad_of(param: nn.Parameter) -> torch.Tensor | None:
    """:func:`_main_or_grad`; for an FSDP shard (a DTensor) this rank's local piece of it."""
    grad = _main_or_grad(param)
    return grad.to_local() if isinstance(grad, DTensor) else grad


def allreduce_sequence_parallel_grads(module: nn.Module, *, tp_group=None) -> None:
    """Sum over TP the gradients of parameters marked ``sequence_parallel``.

    Under SP each rank sees 1/TP of the tokens, so the gradient of a parameter replicated over
    TP (LayerNorm weights, the row-parallel bias) is partial until summed. One all-reduce of a
    flat buffer covers all of them. Uses ``main_grad`` where a parameter has one. On a model
    under :func:`tensorpar.fully_shard` it sums the DP shards (every TP rank holds the same
    slice of a replicated parameter), after FSDP's reduce-scatter. A TP-invariant model's are
    summed in rank order (a tree).
    """
    summed = all_reduce_tree if is_tp_invariant(module.parameters()) else comm.all_reduce
    sum_sequence_parallel_grads(module, tp_group=tp_group, summed=summed)


def sum_sequence_parallel_grads(module: nn.Module, *, tp_group, summed) -> None:
    """:func:`allreduce_sequence_parallel_grads` with ``summed(flat, group)`` (returning the sum
    over TP) as the reduction: one flat buffer per dtype."""
    group = resolve_tp_group(tp_group)
    grads = [g for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and (g := _grad_of(p)) is not None]
    if not grads or comm.group_size(group) == 1:
        return
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        flat = summed(flat, group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class _Bucket:
    """A contiguous fp32 gradient buffer shared by consecutive parameters."""

    def __init__(self, params: list[nn.Parameter], buffer: torch.Tensor, group) -> None:
        self.params, self.buffer, self.group = params, buffer, group
        self.ready: set[int] = set()
        self.handle = None


class DataParallelGradReducer:
    """Gives every parameter an fp32 ``main_grad`` and averages them over DP during backward.

    ``main_grad`` views live in contiguous buckets of about ``bucket_bytes``, filled in reverse
    parameter order (the order backward produces them). A post-accumulate-grad hook moves each
    ``.grad`` into ``main_grad`` (or, for layers with ``gradient_accumulation_fusion``, which
    wrote ``main_grad`` themselves, just drops their placeholder, Megatron's
    ``grad_added_to_main_grad`` protocol; a fused weight also used elsewhere, such as an
    embedding tied to the LM head, carries ``zero_out_wgrad = True``: its fused layer hands
    autograd zeros and the other uses' ``.grad`` is added); when the last parameter of a bucket arrives, the
    bucket's all-reduce is launched asynchronously, while backward continues. Only the last
    micro-batch of a gradient-accumulation step reduces (``sync=False`` for the others). From a
    bucket's launch until :meth:`zero_grad`, its parameters carry ``main_grad_reduced = True``:
    deferred weight gradients (``defer_wgrad_compute``) must be added before that; a weight with
    some pending (``deferred_wgrad_pending``) keeps its bucket for :meth:`finish`.

    One optimizer step::

        reducer.zero_grad()
        for k, batch in enumerate(micro_batches):
            reducer.sync = k == len(micro_batches) - 1
            loss(batch).backward()
        reducer.finish()          # waits for the buckets; param.grad is now main_grad
        optimizer.step()

    Parameters in a lower precision than fp32 (bf16) keep their gradient in ``main_grad``
    only (``.grad`` cannot hold fp32): step them through :class:`MasterWeights`. A TP-invariant
    model's buckets are summed in rank order (a tree, when the bucket fills), so an element's sum
    does not depend on where the TP layout puts it in a bucket. Given ``micro_batches`` (a
    TP-invariant model only), each parameter's gradients of the step's ``micro_batches`` backwards
    are summed in a fixed tree (:class:`~tensorpar.distributed.tree_reduce.HalvingTree`, ``sync`` unused) and
    the DP sum finishes that tree, with no division: a loss divided by the global number of
    micro-batches gives the same bits at any DP size (the training loop's invariant mode).

    Expert parameters (``allreduce = False``, :mod:`tensorpar.expert_parallel`) are bucketed apart
    and summed over ``expert_dp_group`` (their replicas: TP x CP x DP / EP) instead, divided by
    the DP size like the rest: an expert's gradient already holds its whole EP group's tokens.
    """

    def __init__(self, params, *, dp_group, bucket_bytes: int = 25 * 2**20, micro_batches: int | None = None,
                 expert_dp_group=None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.ordered = is_tp_invariant(self.params)
        if micro_batches is not None and not self.ordered:
            raise ValueError("DataParallelGradReducer: micro_batches= sums in the invariant mode's tree; "
                             "the model is not tp_invariant")
        self.trees = None if micro_batches is None else {
            id(p): SourceTrees(sources=getattr(p, "expert_sources", 1), leaves=micro_batches) for p in self.params}
        self.group = dp_group
        self.dp_size = comm.group_size(dp_group)
        self.sync = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        groups = {True: dp_group, False: dp_group if expert_dp_group is None else expert_dp_group}
        pending: dict[bool, list[nn.Parameter]] = {True: [], False: []}
        for param in reversed(self.params):
            dense = getattr(param, "allreduce", True)
            pending[dense].append(param)
            if sum(p.numel() for p in pending[dense]) * 4 >= bucket_bytes:
                self._add_bucket(pending[dense], groups[dense])
                pending[dense] = []
        for dense, rest in pending.items():
            if rest:
                self._add_bucket(rest, groups[dense])
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _add_bucket(self, params: list[nn.Parameter], group) -> None:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
        bucket = _Bucket(list(params), buffer, group)
        offset = 0
        for p in params:
            p.main_grad = buffer[offset:offset + p.numel()].view(p.shape)
            p.grad_added_to_main_grad = p.main_grad_reduced = False
            offset += p.numel()
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.trees is not None:
            if param.grad is not None:  # None: an earlier hook took it (a pipeline's, for add_grad)
                grad, param.grad = param.grad, None
                self.add_grad(param, grad)
            return
        if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
            param.main_grad.add_(param.grad)
        param.grad = None
        param.grad_added_to_main_grad = False
        if self.sync:
            self._ready(param)

    def add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add the next micro-batch's gradient of ``param`` to its tree (``micro_batches=``).

        An expert's gradients of its other sources come with it (:func:`take_source_grads`).

        What the hook does with each ``.grad``, for a caller that takes the micro-batches'
        gradients apart itself and hands them over in micro-batch order (a pipeline schedule in
        the invariant mode).

        Example::

            reducer.add_grad(param, grad_of_micro_batch_k)   # k = 0, 1, ... in order
        """
        if self.trees is None:
            raise ValueError("DataParallelGradReducer.add_grad: only with micro_batches= (the invariant mode's tree)")
        total = self.trees[id(param)].add(take_source_grads(param, grad))
        if total is None:  # the step's micro-batches are not all in yet
            return
        param.main_grad.copy_(total)
        param.grad_added_to_main_grad = False
        self._ready(param)

    def _ready(self, param: nn.Parameter) -> None:
        """Mark ``param``'s gradient complete; launch its bucket's reduction once all are."""
        if getattr(param, "deferred_wgrad_pending", False):
            # Deferred wgrads (defer_wgrad_compute) reach main_grad later: the bucket waits for finish().
            return
        bucket = self._bucket_of[id(param)]
        if bucket.handle is not None:
            raise RuntimeError("a parameter's gradient arrived after its bucket was reduced: "
                               "call backward once per micro-batch and finish() before the next")
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            # Read by ColumnParallelLinear.compute_deferred_wgrads: too late to add to main_grad.
            p.main_grad_reduced = True
        if self.dp_size > 1 and self.trees is None:
            bucket.buffer.div_(self.dp_size)
        if self.ordered:
            bucket.buffer.copy_(all_reduce_tree(bucket.buffer, bucket.group))
            bucket.handle = comm.Handle(None, bucket.buffer)
        else:
            bucket.handle = comm.all_reduce(bucket.buffer, bucket.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket (launching those with unused parameters); set ``.grad`` of fp32 parameters."""
        short = [tree.count for tree in (self.trees or {}).values() if tree.count not in (0, tree.leaves)]
        if short:
            raise RuntimeError(f"DataParallelGradReducer: finish() after {short[0]} of the micro_batches="
                               f"{next(iter(self.trees.values())).leaves} backwards its tree sums")
        for bucket in self.buckets:
            if bucket.handle is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle = None
            bucket.ready.clear()
        for p in self.params:
            if p.dtype == p.main_grad.dtype:
                p.grad = p.main_grad

    def zero_grad(self) -> None:
        for tree in (self.trees or {}).values():
            tree.reset()
        for bucket in self.buckets:
            bucket.buffer.zero_()
        for p in self.params:
            p.grad = None
            p.main_grad_reduced = False

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class MasterWeights:
    """fp32 master copies of low-precision parameters for a ``torch.optim`` optimizer.

    Megatron's mixed-precision layout, the one way tensorpar supports bf16 parameters: forward
    and backward run on the bf16 parameters, :class:`DataParallelGradReducer` accumulates their
    fp32 ``main_grad`` (fused layers write it directly), the optimizer steps fp32 masters whose
    ``.grad`` *is* that ``main_grad`` (no copy), and :meth:`step` rounds the masters back into
    the parameters. fp32 parameters are their own masters. Checkpoint ``params`` (the masters),
    not the rounded model, to resume exactly. Weights loaded into the model after construction
    (``load_state_dict``, a checkpoint, ``load_weights``) replace their masters at the next
    :meth:`step`: a parameter changed in place since the last step (its autograd version
    counter moved) is copied into its master first. Writes through ``.data`` bypass the
    counter: call :meth:`refresh` after them.

    Example::

        reducer = tp.DataParallelGradReducer(model.parameters(), dp_group=dp_group)
        master = tp.MasterWeights(model.parameters())
        optimizer = torch.optim.AdamW(master.params, lr=3e-4)
        reducer.zero_grad(); loss.backward(); reducer.finish()
        tp.clip_grad_norm_(model.parameters(), 1.0)      # reads and scales main_grad
        master.step(optimizer)
    """

    def __init__(self, params) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        missing = [tuple(p.shape) for p in self.model_params if not hasattr(p, "main_grad")]
        if missing:
            raise ValueError(f"MasterWeights: parameters of shapes {missing[:3]} have no main_grad; "
                             "create the DataParallelGradReducer first")
        self.params = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_()
                       for p in self.model_params]
        self._versions = self._model_versions()

    def _model_versions(self) -> list[int]:
        return [p._version for p in self.model_params]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's parameters into the masters (after writing them through ``.data``)."""
        for param, master in zip(self.model_params, self.params):
            if master is not param:
                master.copy_(param)
        self._versions = self._model_versions()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` on the masters, then copy them into the model's parameters."""
        for param, master, seen in zip(self.model_params, self.params, self._versions):
            if master is not param and param._version != seen:
                master.copy_(param)  # loaded since the last step: the model's weights win
            master.grad = param.main_grad
        optimizer.step()
        for param, master in zip(self.model_params, self.params):
            if master is not param:
                param.copy_(master)
        self._versions = self._model_versions()


def _without_duplicate_rows(grad: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """``grad`` with zeros at the rows an earlier TP rank holds too (replicated K/V heads)."""
    rows = getattr(param, "tp_duplicate_rows", None)
    if rows is None or rows.numel() == 0:
        return grad
    return grad.index_fill(0, rows.to(grad.device), 0)


def gather_dim0_shards(local: torch.Tensor, rows: int, group) -> torch.Tensor:
    """The whole tensor of ``rows`` rows from this rank's dim-0 piece of it, split as FSDP splits
    (``ceil(rows / n)`` rows per rank of ``group``, the last ones shorter or empty; collective).

    Example: ``gather_dim0_shards(p.grad.to_local(), p.shape[0], dp_group)`` under ``fully_shard``.
    """
    n = comm.group_size(group)
    if n == 1:
        return local
    per_rank = -(-rows // n)
    return comm.all_gather(local, group, dim=0, sizes=[max(0, min(per_rank, rows - i * per_rank)) for i in range(n)])


def _shards_group(sharded: list[DTensor], dp_group) -> dist.ProcessGroup:
    """The group FSDP shards ``sharded`` over: ``dp_group`` (default DP), which under HSDP must be the shard group."""
    dp_group = dp_group if dp_group is not None else get_data_parallel_group()
    mesh = sharded[0].device_mesh
    if mesh.ndim == 2 and comm.group_size(dp_group) != mesh.size(1):  # HSDP: the shards of one replica
        raise ValueError(f"get_grad_norm: HSDP shards split over {mesh.size(1)} ranks, not dp_group's "
                         f"{comm.group_size(dp_group)}: pass dp_group=tensorpar.data_parallel.fsdp.shard_group(param)")
    return dp_group


def _square(grads: list[torch.Tensor], group) -> torch.Tensor:
    """The sum of squares of ``grads`` (fp32), on ``group``'s collective device when there are none."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=comm.collective_device(group))
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()


@torch.no_grad()
def get_grad_norm(params, *, tp_group=None, dp_group=None, pp_group=None, ep_group=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (fp32 scalar), identical on every TP x DP rank
    (and, given the pipeline group ``pp_group``, over the stages of every rank of it).

    Each element is counted once: TP shards by every rank, replicated parameters by TP
    rank 0 only, rows several ranks hold (``tp_duplicate_rows``: replicated K/V heads) by the
    first of them, and the squares are summed over TP. FSDP shards (DTensor gradients, see
    :func:`tensorpar.fully_shard`) are summed over ``dp_group`` too (default: the DP
    group; under HSDP the shard group, which each replica holds whole); plain gradients are replicated over DP and counted as they are. Uses
    ``main_grad`` where present. A parameter marked ``shared`` (a pipeline's copy of the tied
    embedding on the last stage, as Megatron marks it) is counted by its original only. Expert
    parameters (``expert_parallel``) are counted by each rank of ``ep_group`` that holds them,
    the same on every TP rank (they are whole, and equal over their replicas once reduced).
    One ``torch._foreach_norm`` per kind, and no host
    synchronisation. A TP-invariant model's norm is summed in a fixed order (:func:`_ordered_grad_norm`).
    """
    group = resolve_tp_group(tp_group)
    params = list(params)
    if is_tp_invariant(params):
        return _ordered_grad_norm(params, group, pp_group, dp_group=dp_group, ep_group=ep_group)
    plain, sharded, experts = [], [], []
    for p in params:
        grad = _main_or_grad(p)
        if grad is not None and getattr(p, "expert_parallel", False):
            experts.append(grad)
        elif grad is not None and param_is_not_tensor_parallel_duplicate(p, group) and not getattr(p, "shared", False):
            if isinstance(grad, DTensor):
                sharded.append(grad)
            else:
                plain.append(_without_duplicate_rows(grad, p))
    square = _square(plain, group)
    if sharded:
        dp_group = _shards_group(sharded, dp_group)
        shard_square = _square([g.to_local() for g in sharded], dp_group)
        comm.all_reduce(shard_square, dp_group)
        square = square + shard_square
    comm.all_reduce(square, group)
    if experts:
        expert_square = _square(experts, group)
        if ep_group is not None:
            comm.all_reduce(expert_square, ep_group)
        square = square + expert_square
    if pp_group is not None:
        comm.all_reduce(square, pp_group)
    return square.sqrt()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, *, tp_group=None, dp_group=None, pp_group=None,
                    ep_group=None) -> torch.Tensor:
    """Scale gradients so the TP x DP-aware total norm (:func:`get_grad_norm`) is at most
    ``max_norm``; returns the norm. Works on FSDP shards as on plain gradients, and on a
    TP-invariant model's (its norm's bits do not depend on the TP size).

    The scale is clamped on the device and applied to every gradient (by 1 when the norm is
    already small): the CPU never waits for the norm.
    """
    params = list(params)
    norm = get_grad_norm(params, tp_group=tp_group, dp_group=dp_group, pp_group=pp_group, ep_group=ep_group)
    grads = [g for p in params if (g := _grad_of(p)) is not None]
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    # One foreach call per kind: FSDP's shards (their local pieces) and whole tensors (experts) apart.
    for kind in (True, False):
        same = [g for g in grads if isinstance(g, DTensor) == kind]
        if same:
            torch._foreach_mul_(same, scale)
    return norm


def _block_squares(grad: torch.Tensor, stride: int, blocks: int) -> list[torch.Tensor]:
    """Per local block group ``i``: the sum of squares of block ``i`` of every stride piece (in
    order) of ``grad``, its split dimension first."""
    # [stride, blocks, elements]: each block contiguous (one copy where the blocks are columns).
    squares = grad.reshape(stride, blocks, -1).square()
    sums = []
    for i in range(blocks):
        total = squares[0, i].sum()
        for j in range(1, stride):
            total = total + squares[j, i].sum()
        sums.append(total)
    return sums


def _tp_blocks(params) -> int:
    """The fixed blocks of the TP-split ``params`` (``tp_blocks``, set by the invariant layers;
    one count per model, the embedding's grad cut the same way), ``BLOCKS`` where none says."""
    counts = {p.tp_blocks for p in params if hasattr(p, "tp_blocks")}
    if len(counts) > 1:
        raise ValueError(f"tp_invariant: the parameters are cut into different numbers of fixed blocks "
                         f"({sorted(counts)}): one model, one count")
    return counts.pop() if counts else BLOCKS


def _expert_squares(grad: torch.Tensor, ep_group) -> torch.Tensor:
    """The sum of squares of an expert weight's gradient (``[experts here, ...]``) over every
    expert of ``ep_group``: one sum per expert (the same tensor at every EP size), gathered, then
    added in expert order."""
    per_expert = torch.stack([g.square().sum() for g in grad])
    if ep_group is not None and comm.group_size(ep_group) > 1:
        per_expert = comm.all_gather(per_expert.to(comm.collective_device(ep_group)), ep_group).to(grad.device)
    total = per_expert[0]
    for square in per_expert[1:]:
        total = total + square
    return total


def _ordered_grad_norm(params: list[nn.Parameter], group, pp_group=None, *, dp_group=None,
                       ep_group=None) -> torch.Tensor:
    """The L2 norm of the gradient (fp32), the same bits at every TP and PP size.

    Each parameter gives a row: the sums of squares of its fixed blocks (TP-sharded ones) and
    of the whole (replicated ones). The rows are added in the PP=1 model's parameter order (with
    ``pp_group``, gathered from every stage and ordered by ``pipeline_stage``); then a tree over
    the blocks (a rank's blocks form a subtree, finished across TP ranks), plus the replicated
    part. Gradients are whole on every DP rank, FSDP shards (DTensors) gathered to it over
    ``dp_group`` first: no DP sum; a pipeline's tied copy (``shared``) is counted by its original only.
    An expert weight's row holds every expert's sum of squares (:func:`_expert_squares` over ``ep_group``).
    """
    leaves = _tp_blocks(params)
    blocks = leaves // comm.group_size(group)
    device = comm.collective_device(group)
    rows = []
    for param in params:
        grad = _main_or_grad(param)
        if grad is None or getattr(param, "shared", False):
            continue
        if isinstance(grad, DTensor):  # the blocks' squares need the whole TP shard
            grad = gather_dim0_shards(grad.to_local(), grad.shape[0], _shards_group([grad], dp_group))
        grad = grad.float()
        if getattr(param, "expert_parallel", False):  # each expert's own sum, then the experts in order
            squares = [grad.new_zeros(()) for _ in range(blocks)] + [_expert_squares(grad, ep_group)]
        elif getattr(param, "tensor_model_parallel", False):
            # Rows every rank holds whole (``tp_shared_rows``: grouped K/V heads) count as a replicated tensor.
            grad, shared = grad.movedim(param.partition_dim, 0), getattr(param, "tp_shared_rows", 0)
            split = grad.shape[0] - shared
            stride = 1 if shared else getattr(param, "partition_stride", 1)
            squares = [*_block_squares(grad[:split], stride, blocks), grad[split:].square().sum()]
        else:
            squares = [grad.new_zeros(()) for _ in range(blocks)] + [grad.square().sum()]
        stage = torch.tensor(float(getattr(param, "pipeline_stage", 0)), device=grad.device)
        rows.append(torch.stack([stage, *squares]).to(device))
    table = torch.stack(rows) if rows else torch.zeros(0, blocks + 2, device=device)
    if pp_group is not None and comm.group_size(pp_group) > 1:
        sizes = comm.all_gather(comm.scalars([len(rows)], pp_group, dtype=torch.int64), pp_group).tolist()
        table = comm.all_gather(table, pp_group, sizes=sizes)
        table = table[torch.sort(table[:, 0], stable=True).indices]
    # One add per parameter, in order, from zero (0 + x is x): each block's sum as at PP=1.
    total_squares = torch.zeros(blocks + 1, device=device)
    for row in table[:, 1:]:
        total_squares = total_squares + row
    first = comm.group_rank(group) * blocks
    local = subtree_sums([part.reshape(1) for part in total_squares[:blocks].clone().unbind()], first=first,
                         leaves=leaves)
    total = all_reduce_subtrees(local, group, leaves=leaves)[0]
    return (total + total_squares[blocks]).sqrt()
