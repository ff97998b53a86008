"""Sharded data parallelism (ZeRO-3) composed with TP: torch's FSDP2 over the DP group.

Each rank holds a TP shard of every TP-parallel weight; FSDP2 (``torch.distributed.fsdp.
fully_shard``) shards that local tensor once more along dim 0 over the DP group, so
parameters, gradients and optimizer state end up 1/DP per rank. Before a unit's forward and
backward FSDP all-gathers its parameters over DP; after backward it reduce-scatters (and
averages) their gradients, with torch's own collectives. The TP layers see ordinary tensors in between.

Mixed precision is FSDP's: parameters stay fp32 (the sharded fp32 parameters are the master
weights), ``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=
torch.float32)`` gathers them in bf16 for compute and reduces and accumulates gradients in
fp32. So there is no ``main_grad``, no :class:`~tensorpar.data_parallel.grads.DataParallelGradReducer` and
no :class:`~tensorpar.data_parallel.grads.MasterWeights` under FSDP, and ``gradient_accumulation_fusion``
(which writes ``main_grad`` from inside the layer) cannot combine with it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
# FSDP2's hook for custom collectives (FSDPModule.set_custom_all_gather/_reduce_scatter): the
# defaults, subclassed, keep FSDP's own paths and let CommLedger see each call.
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor

from ..distributed import comm, comm_ledger
from .fsdp_mesh import dp_mesh, full_box, hsdp_mesh, replica_group, shard_group, tp_dp_mesh
from .grads import DataParallelGradReducer, gather_dim0_shards, is_tp_invariant
from ..parallel_state import get_data_parallel_group
from ..distributed.tree_reduce import HalvingTree, all_reduce_tree, reduce_scatter_tree

__all__ = ["fully_shard", "reshard", "is_fully_sharded", "dp_mesh", "hsdp_mesh", "shard_group", "gather_dp_shards",
           "replica_group", "scatter_dp_shard", "tp_dp_mesh", "full_box", "ShardedGradSync", "describe", "bytes_per_rank",
           "take_unsharded_grad", "MIN_UNIT_MIB", "check_min_unit_mib", "least_unit_bytes"]

# The default least size of an FSDP unit: DDP's bucket size (its bucket_cap_mb).
MIN_UNIT_MIB = 25.0


def _units(model: nn.Module) -> list[FSDPModule]:
    """One module of each FSDP unit in ``model`` (the modules of a list unit share one state)."""
    first = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            first.setdefault(id(_torch_fully_shard.state(module)), module)
    return list(first.values())


def reshard(model: nn.Module) -> None:
    """Free every gathered FSDP unit of ``model``, so its parameters are the shards again."""
    for unit in _units(model):
        unit.reshard()


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP shards (DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def gather_dp_shards(tensor: torch.Tensor, *, dp_group=None) -> torch.Tensor:
    """This rank's whole TP shard from an FSDP shard (a DTensor split on dim 0 over ``dp_group``,
    default the group it is sharded over; collective).

    One all-gather of the dim-0 pieces (:func:`~tensorpar.data_parallel.grads.gather_dim0_shards`). Other
    tensors come back as they are.
    """
    if not isinstance(tensor, DTensor):
        return tensor
    group = dp_group if dp_group is not None else shard_group(tensor)
    return gather_dim0_shards(tensor.to_local(), tensor.shape[0], group)


def consecutive_groups(sizes: list[int], *, at_least: int) -> tuple[list[list[int]], list[int]]:
    """Split the indices of ``sizes`` into runs in order, each closed once its sizes sum to
    ``at_least``; returns the runs and the trailing indices whose sizes sum to less.

    Example: ``consecutive_groups([3, 3, 3, 3, 3], at_least=5)`` is ``([[0, 1], [2, 3]], [4])``.
    """
    groups, run, total = [], [], 0
    for index, size in enumerate(sizes):
        run.append(index)
        total += size
        if total >= at_least:
            groups.append(run)
            run, total = [], 0
    return groups, run


@torch.no_grad()
def scatter_dp_shard(shard: DTensor, whole: torch.Tensor, *, dp_group=None) -> None:
    """Copy this rank's dim-0 piece of ``whole`` (as :func:`gather_dp_shards` returns) into ``shard``."""
    group = dp_group if dp_group is not None else shard_group(shard)
    local = shard.to_local()
    start = comm.group_rank(group) * -(-whole.shape[0] // comm.group_size(group))
    local.copy_(whole[start:start + local.shape[0]])


class _RecordedAllGather(DefaultAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        comm_ledger.record("all_gather", output_tensor, comm.group_size(group), async_op)
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _RecordedReduceScatter(DefaultReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        comm_ledger.record("reduce_scatter", input_tensor, comm.group_size(group), async_op,
                           "avg" if op == dist.ReduceOp.AVG else "sum")
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class _TreeReduceScatter(DefaultReduceScatter):
    """The invariant mode's reduction of one FSDP unit's gradients, in place of FSDP's reduce-scatter.

    Each backward's unsharded gradients (FSDP's flat reduce-scatter input) go into a
    :class:`~tensorpar.distributed.tree_reduce.HalvingTree` of the step's ``micro_batches``, as
    :class:`~tensorpar.data_parallel.grads.DataParallelGradReducer` sums them; once the last is in, the tree is
    finished over the shard group in rank order (:func:`~tensorpar.distributed.tree_reduce.reduce_scatter_tree`:
    each element summed as the unsharded reducer's all-reduce sums it) and this rank keeps its
    slice. Under HSDP the shard groups are consecutive DP ranks, so the replicas finish the tree
    (:func:`~tensorpar.distributed.tree_reduce.all_reduce_tree`); the first replica hands FSDP the sum, the
    others zeros, which FSDP's own all-reduce across the replicas adds exactly. Before the last
    micro-batch FSDP gets zeros, accumulated into the sharded gradient as exactly ``0 + sum``.
    Under CP (``cp_group``) every CP rank already holds the whole gradient (the mode's layers sum
    it over CP in backward) and CP is the inner index of the DP x CP shard group: only CP rank 0
    enters its sum, the others -0.0, so the tree over DP x CP adds what the DP ranks' tree adds.
    Backwards arrive in micro-batch order, or, where ``micro_batch`` names the one in hand (a
    pipeline's), in any order: a part waits until those before it are in.
    """

    def __init__(self, *, micro_batches: int, replicate_group=None, cp_group=None) -> None:
        self.tree = HalvingTree(leaves=micro_batches)
        self.replicate_group = replicate_group
        self.enters_tree = cp_group is None or comm.group_rank(cp_group) == 0
        self.micro_batch: int | None = None
        self.waiting: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        self.tree.reset()
        self.waiting.clear()

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        # FSDP frees its input after the call; the tree adds into its parts in place.
        self.waiting[self.tree.count if self.micro_batch is None else self.micro_batch] = input_tensor.clone()
        total = None
        while self.tree.count in self.waiting:
            total = self.tree.add(self.waiting.pop(self.tree.count))
        if total is None:
            output_tensor.zero_()
            return None
        if not self.enters_tree:  # x + -0.0 is x for every x, -0.0 too (+0.0 would make a -0.0 sum +0.0)
            total.fill_(-0.0)
        shard = reduce_scatter_tree(total, group)
        if self.replicate_group is not None:
            shard = all_reduce_tree(shard, self.replicate_group)
            if comm.group_rank(self.replicate_group) > 0:
                shard.zero_()
        output_tensor.copy_(shard)
        return None


def check_min_unit_mib(min_unit_mib, what: str) -> None:
    """Refuse a ``min_unit_mib`` that is no finite number of MiB >= 0, in one line naming ``what``."""
    if isinstance(min_unit_mib, bool) or not isinstance(min_unit_mib, (int, float)) or not 0 <= min_unit_mib < math.inf:
        raise ValueError(f"{what}: min_unit_mib must be a number of MiB >= 0, got {min_unit_mib!r}")


def least_unit_bytes(config, min_unit_mib: float) -> int:
    """The bytes of parameters at which a unit of consecutive blocks of a GPT ``config`` closes:
    ``min_unit_mib``, or 0 (one block per unit) where the blocks recompute in backward, since
    FSDP2 takes each recomputed block of a unit as a call of its own and reduce-scatters,
    frees and gathers the unit again after it."""
    return 0 if getattr(config, "recompute", False) else math.ceil(min_unit_mib * 2**20)


def _default_units(model: nn.Module, min_unit_mib: float) -> list[nn.Module | list[nn.Module]]:
    """A GPT's transformer blocks (any model with a ``blocks`` ModuleList), consecutive ones one
    unit until it holds :func:`least_unit_bytes` of this rank's parameters; the blocks after the
    last such unit stay in the root."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"fully_shard: units= is required for a {type(model).__name__} "
                         "(the default, transformer blocks grouped into units, knows a GPT's `blocks`)")
    sizes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks]
    groups, _ = consecutive_groups(sizes, at_least=least_unit_bytes(getattr(model, "config", None), min_unit_mib))
    return [blocks[g[0]] if len(g) == 1 else [blocks[i] for i in g] for g in groups]


def _parameters(unit: nn.Module | list[nn.Module]) -> list[nn.Parameter]:
    return [p for module in (unit if isinstance(unit, list) else [unit]) for p in module.parameters()]


def _refuse(model: nn.Module, units: list[nn.Module]) -> None:
    """One line naming what cannot combine with FSDP."""
    if is_fully_sharded(model):
        raise ValueError("fully_shard: the model is already fully sharded")
    fused = sorted({name for name, m in model.named_modules() if getattr(m, "gradient_accumulation_fusion", False)})
    if fused:
        raise ValueError(f"fully_shard: gradient_accumulation_fusion=True ({fused[0]}) writes main_grad, which "
                         "FSDP does not use: build the model with gradient_accumulation_fusion=False")
    for name, p in model.named_parameters():
        if hasattr(p, "main_grad"):
            raise ValueError(f"fully_shard: parameter {name} has a main_grad: FSDP reduces gradients itself; "
                             "create no DataParallelGradReducer or MasterWeights for a sharded model")
        if getattr(p, "partition_rows", None) is not None and not getattr(p, "tp_shared_rows", 0):
            raise ValueError(f"fully_shard: parameter {name} has an uneven TP layout (heads, K/V heads or FFN rows "
                             "that TP does not divide), which FSDP cannot shard yet: choose a --tp that divides them")
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"fully_shard: parameter {name} is {p.dtype}; keep parameters float32 and pass "
                             "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    seen: dict[int, int] = {}
    for index, unit in enumerate(units):
        for p in _parameters(unit):
            if seen.setdefault(id(p), index) != index:
                raise ValueError(f"fully_shard: units {seen[id(p)]} and {index} share a parameter (a tied "
                                 "weight): leave it to one unit or to the root")
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    embedding = getattr(getattr(model, "embedding", None), "word", None)
    if tied and embedding is not None and id(embedding.weight) in seen:
        raise ValueError("fully_shard: the tied embedding weight is also the LM head's; it must stay in the "
                         "root unit, not in units=")


def fully_shard(model: nn.Module, *, dp_group=None, units=None, min_unit_mib: float = MIN_UNIT_MIB,
                reshard_after_forward: bool = True, mp_policy: MixedPrecisionPolicy | None = None,
                dp_replicate: int = 1) -> nn.Module:
    """Shard ``model`` over ``dp_group`` (default: the DP group) with FSDP2, composed with TP.

    ``dp_replicate=R`` gives HSDP: FSDP2 on the 2-D mesh :func:`hsdp_mesh`, each parameter
    sharded over ``DP / R`` consecutive DP ranks and replicated over the ``R`` replicas (FSDP
    reduce-scatters within a replica, then all-reduces across them); pass
    ``dp_group=shard_group(p)`` to ``clip_grad_norm_``, which sums the shards' squares over it.

    One FSDP unit per entry of ``units`` (a module, or a list of modules gathered together),
    then the root: the embedding, final norm and (tied) LM head stay together in it, gathered
    from forward through backward. The default for a :class:`~tensorpar.models.GPT` groups
    consecutive transformer blocks into units of at least ``min_unit_mib`` MiB of this rank's
    parameters (one block each where a block holds that much; ``min_unit_mib=0``, or a model
    that recomputes its blocks: one block per unit), and leaves the blocks after the last such
    unit in the root: every unit costs three collectives a step, each with a fixed cost, the
    reason DDP has buckets. ``reshard_after_forward=False`` keeps each unit gathered between its
    forward and backward (ZeRO-2-like: more memory, one all-gather less). TP attributes (``tensor_model_parallel``, ``sequence_parallel``, ...)
    carry over to the sharded parameters, so ``allreduce_sequence_parallel_grads``,
    ``clip_grad_norm_`` and checkpoints keep working. Expert weights (``expert_parallel``: split
    over an EP group already) are left whole, as plain tensors: :class:`ShardedGradSync` given
    ``expert_dp_group`` reduces their gradients (given another ``dp_group`` than the DP
    group, pass it to ``clip_grad_norm_`` too); :class:`~tensorpar.CommLedger` records FSDP's
    all-gathers and reduce-scatters. Returns the model.

    Example::

        model = tp.fully_shard(GPT(config))
        optimizer = torch.optim.AdamW(model.parameters())   # states are 1/DP shards too
        model(tokens, labels).backward()
        tp.allreduce_sequence_parallel_grads(model)          # under SP
        tp.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    """
    check_min_unit_mib(min_unit_mib, "fully_shard")
    group = dp_group if dp_group is not None else get_data_parallel_group()
    units = _default_units(model, min_unit_mib) if units is None else list(units)
    _refuse(model, units)
    attributes = {name: dict(vars(p)) for name, p in model.named_parameters()}
    mesh = hsdp_mesh(group, dp_replicate)
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    # Expert weights are split by expert parallelism, not by FSDP: ShardedGradSync reduces them.
    experts = {p for p in model.parameters() if getattr(p, "expert_parallel", False)}
    for unit in units:
        _torch_fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                           ignored_params=experts or None)
    # The root keeps FSDP's default: gathered after forward, since backward needs it at once.
    _torch_fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=experts or None,
                       **({} if reshard_after_forward else {"reshard_after_forward": False}))
    for unit in _units(model):
        unit.set_custom_all_gather(_RecordedAllGather())
        unit.set_custom_reduce_scatter(_RecordedReduceScatter())
    for name, p in model.named_parameters():
        for key, value in attributes[name].items():
            setattr(p, key, value)
    return model


class ShardedGradSync:
    """:class:`~tensorpar.data_parallel.grads.DataParallelGradReducer`'s step interface for a fully sharded model.

    FSDP reduce-scatters each unit's gradients during backward; ``sync=False`` (the micro-batches
    before the last of an accumulation step) keeps them unsharded and unreduced until then.
    Given ``micro_batches`` (a TP-invariant model only), each unit's gradients of the step's
    ``micro_batches`` backwards are summed in the invariant mode's fixed tree, finished over the
    DP ranks with no division, in place of FSDP's reduce-scatter (``sync`` unused): each rank's
    shard holds the bits of the unsharded reducer's sum (``DataParallelGradReducer(...,
    micro_batches=)``) at any DP size, with or without FSDP or HSDP. Under context parallelism,
    FSDP sharding over the DP x CP group, pass the CP group as ``cp_group``: its ranks hold the
    same, whole gradient (the mode sums it over CP in backward), which the tree takes once.

    Example::

        grads = ShardedGradSync(model)
        grads.zero_grad()
        for k, batch in enumerate(micro_batches):
            grads.sync = k == len(micro_batches) - 1
            loss(batch).backward()
        grads.finish()
        optimizer.step()
    """

    def __init__(self, model: nn.Module, *, micro_batches: int | None = None, cp_group=None,
                 expert_dp_group=None) -> None:
        self.model = model
        self._sync = True
        self.trees: list[_TreeReduceScatter] = []
        self.experts = [p for p in model.parameters() if getattr(p, "expert_parallel", False)]
        if self.experts and expert_dp_group is None:
            raise ValueError("ShardedGradSync: a model with expert weights needs expert_dp_group= (their replicas)")
        self.expert_dp_group = expert_dp_group
        # The invariant mode's expert weights, whole on each rank: the unsharded reducer's trees.
        self.expert_grads = DataParallelGradReducer(self.experts, dp_group=expert_dp_group,
                                                    micro_batches=micro_batches) \
            if self.experts and micro_batches is not None else None
        shard = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
        # FSDP's reduce-scatter averages over its mesh: the expert weights' sums are divided alike.
        self.divisor = 1 if shard is None else shard.device_mesh.size()
        if cp_group is not None and micro_batches is None:
            raise ValueError("ShardedGradSync: cp_group= applies with micro_batches= (the invariant mode's tree); "
                             "FSDP's own reduce-scatter averages over every rank it shards over")
        if micro_batches is not None:
            self._sum_in_trees(micro_batches, cp_group)

    def _sum_in_trees(self, micro_batches: int, cp_group) -> None:
        params = list(self.model.parameters())
        if not is_tp_invariant(params):
            raise ValueError("ShardedGradSync: micro_batches= sums in the invariant mode's tree; the model is "
                             "not tp_invariant")
        shard = next(p for p in params if isinstance(p, DTensor))
        if comm.group_size(shard_group(shard)) == 1:  # FSDP's reduce-scatter over one rank is a copy, not ours
            raise ValueError("ShardedGradSync: micro_batches= needs FSDP shards over at least 2 ranks")
        if cp_group is not None:
            _check_cp_inner(shard.device_mesh.mesh.reshape(-1).tolist(), dist.get_process_group_ranks(cp_group))
        for module in _units(self.model):
            tree = _TreeReduceScatter(micro_batches=micro_batches, replicate_group=replica_group(shard),
                                      cp_group=cp_group)
            module.set_custom_reduce_scatter(tree)
            module.set_gradient_divide_factor(1.0)  # the loss is divided by the global micro-batch count
            self.trees.append(tree)

    @property
    def sync(self) -> bool:
        return self._sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self._sync = value
        if self.trees:  # every backward hands its gradients to the trees
            return
        for unit in _units(self.model):
            unit.set_requires_gradient_sync(value, recurse=False)

    def reduce_micro_batch(self, stage: nn.Module, micro_batch: int) -> None:
        """Sum the gradients one backward left unreduced in ``stage`` (an FSDP root: a pipeline
        stage, which torch's schedules run without FSDP's reduction until the step's end) into
        the trees, as micro-batch ``micro_batch`` of the step."""
        for tree in self.trees:
            tree.micro_batch = micro_batch
        stage.set_requires_gradient_sync(True)
        try:  # what torch's PipelineStage.perform_reduce_grad runs once, after the last micro-batch
            for state in _torch_fully_shard.state(stage)._state_ctx.all_states:
                for param_group in state._fsdp_param_groups:
                    param_group.post_backward()
        finally:
            stage.set_requires_gradient_sync(False)
            for tree in self.trees:
                tree.micro_batch = None

    def zero_grad(self) -> None:
        """Drop the gradients; a unit an evaluation left gathered (FSDP keeps the root so after a
        forward no backward follows) is resharded, so the step starts from the shards."""
        reshard(self.model)
        for tree in self.trees:
            tree.reset()
        for p in self.model.parameters():
            p.grad = None
        if self.expert_grads is not None:
            self.expert_grads.zero_grad()

    def finish(self) -> None:
        """FSDP's last reduce-scatter completes inside backward; the expert weights' gradients are
        summed over ``expert_dp_group`` here (with ``micro_batches`` in the trees of a
        ``DataParallelGradReducer``). With ``micro_batches``, refuses a step whose trees did not
        get all of them."""
        short = [t.tree.count for t in self.trees if t.tree.count not in (0, t.tree.leaves)]
        if short:
            raise RuntimeError(f"ShardedGradSync: finish() after {short[0]} of the micro_batches="
                               f"{self.trees[0].tree.leaves} backwards its tree sums")
        if self.expert_grads is not None:
            self.expert_grads.finish()
            return
        grads = [p.grad for p in self.experts if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, self.expert_dp_group).div_(self.divisor)
            torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in
                                         zip(flat.split([g.numel() for g in grads]), grads)])

    def remove_hooks(self) -> None:
        """FSDP's hooks stay with the model; the expert weights' reducer's go."""
        if self.expert_grads is not None:
            self.expert_grads.remove_hooks()


def take_unsharded_grad(root: nn.Module, param: nn.Parameter) -> torch.Tensor | None:
    """Remove and return the gradient FSDP holds unreduced for ``param`` (a sharded parameter)
    in the FSDP root ``root`` after a backward without gradient sync, so that FSDP's reduction
    passes it by; None where ``root`` does not hold ``param`` or that backward gave it none."""
    for state in _torch_fully_shard.state(root)._state_ctx.all_states:
        for fsdp_param in (fp for param_group in state._fsdp_param_groups for fp in param_group.fsdp_params):
            if fsdp_param.sharded_param is param:
                if fsdp_param.unsharded_accumulated_grad is not None:
                    grad, fsdp_param.unsharded_accumulated_grad = fsdp_param.unsharded_accumulated_grad_data, None
                    return grad
                if fsdp_param.unsharded_param.grad is None:
                    return None
                grad, fsdp_param.unsharded_param.grad = fsdp_param.unsharded_grad_data, None  # under TP: the local part
                return grad
    return None


def _check_cp_inner(mesh_ranks: list[int], cp_ranks: list[int]) -> None:
    """Refuse a CP group that is not one aligned run of the FSDP mesh's ranks (in the mesh's order,
    the tree's): only then are CP rank 0's sums the leaves of the DP ranks' tree."""
    size = len(cp_ranks)
    if not any(mesh_ranks[i:i + size] == cp_ranks for i in range(0, len(mesh_ranks), size)):
        raise ValueError(f"ShardedGradSync: cp_group= ranks {cp_ranks} are not one aligned run of the FSDP mesh's "
                         f"ranks {mesh_ranks}: shard over the DP x CP group, CP its inner index")


def describe(model: nn.Module) -> str:
    """Which of the FSDP mesh's dimensions shards over which ranks, and which replicates (this
    rank's groups), and in how many units, for a run header.

    Example: ``"HSDP on a 2 x 2 mesh: dim 0 (dp_replicate) replicates over ranks [0, 2], dim 1
    (dp_shard) shards each TP shard 1/2 over ranks [0, 1], in 3 units"``.
    """
    mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh
    grid = mesh.mesh.reshape(-1, mesh.shape[-1]).tolist()  # rows: the shard groups
    me = dist.get_rank()
    row = next(r for r in grid if me in r)
    count = len(_units(model))
    shards = f"shards each TP shard 1/{len(row)} over ranks {row}, in {count} unit{'s' * (count > 1)}"
    if mesh.ndim == 1:
        return f"FSDP {shards}"
    column = [r[row.index(me)] for r in grid]
    return (f"HSDP on a {len(grid)} x {len(row)} mesh: dim 0 ({mesh.mesh_dim_names[0]}) replicates over ranks "
            f"{column}, dim 1 ({mesh.mesh_dim_names[1]}) {shards}")


def bytes_per_rank(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of parameters, fp32 gradients and AdamW's two fp32 moments.

    Counts the local piece of FSDP shards; plain parameters are whole on every DP rank.
    """
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
    numel = sum(t.numel() for t in local)
    return {"parameters": sum(t.numel() * t.element_size() for t in local),
            "gradients": 4 * numel, "optimizer state": 8 * numel}
