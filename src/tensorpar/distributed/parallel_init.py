"""``initialize_model_parallel`` and ``destroy_model_parallel``: Megatron-core 0.16.1's layout.

The rank lists come from :class:`~tensorpar.distributed.rank_generator.RankGenerator` (the same on every
rank); :class:`~tensorpar.distributed.process_groups.GroupMaker` turns them into process groups, one per
distinct rank list, created in the same order everywhere; :mod:`tensorpar.distributed.parallel_registry`
keeps this rank's. Read them through :mod:`tensorpar.parallel_state`.

Example::

    tp.initialize_model_parallel(2, 2, order="tp-cp-ep-dp-pp")
    tp.destroy_model_parallel()
"""

from __future__ import annotations

import datetime
import math
import warnings

import torch
import torch.distributed as dist

from .parallel_registry import CREATED, GROUPS, HYBRID_DP_CP_GROUPS, OVERRIDES, RANKS, STATE, VIRTUAL_PP
from .process_groups import (
    GroupMaker,
    as_timedelta,
    create_group,
    get_nccl_options,
    init_default_group,
    overwrite_nccl_comm_cfgs,
    select_cuda_device,
    warn_if_overlap_unavailable,
)
from .rank_generator import (
    ParallelLayoutError,
    RankGenerator,
    default_embedding_ranks,
    default_position_embedding_ranks,
    hierarchical_rank_groups,
)


def _check_sizes(**sizes) -> None:
    bad = {k: v for k, v in sizes.items() if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1)}
    if bad:
        raise ValueError("parallel sizes must be positive ints, got "
                         + ", ".join(f"{k}={v!r}" for k, v in bad.items()))


def _refuse_unsupported(use_sharp, sharp_enabled_group, nccl_communicator_config_path,
                        pipeline_model_parallel_comm_backend) -> None:
    refused = []
    if use_sharp or sharp_enabled_group is not None:
        refused.append(f"use_sharp={use_sharp}, sharp_enabled_group={sharp_enabled_group!r} (SHARP)")
    if nccl_communicator_config_path is not None:
        refused.append(f"nccl_communicator_config_path={nccl_communicator_config_path!r} (pass "
                       "high_priority_stream_groups= instead; tensorpar reads no NCCL config file)")
    if pipeline_model_parallel_comm_backend not in (None, "nccl", "gloo"):
        refused.append(f"pipeline_model_parallel_comm_backend={pipeline_model_parallel_comm_backend!r} "
                       "(None, 'nccl' or 'gloo')")
    if refused:
        raise ValueError("initialize_model_parallel: not supported by tensorpar: " + "; ".join(refused))


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
    *,
    backend: str | None = None,
    timeout=None,
) -> None:
    """Create every group of Megatron's layout, initialising the default process group first if needed.

    Megatron-core 0.16.1's arguments and layout. ``backend`` (for the default group this
    creates) defaults to NCCL when CUDA is available and gloo otherwise; ``timeout`` (seconds or
    ``timedelta``, default ``distributed_timeout_minutes``) bounds every collective, so a peer
    that never joins raises instead of hanging. Under NCCL the rank's GPU is selected
    (:func:`select_cuda_device`) whoever created the process group.

    Example::

        tp.initialize_model_parallel(2, 2, context_parallel_size=1, order="tp-cp-ep-dp-pp")
    """
    if GROUPS:
        raise RuntimeError("tensorpar model parallel is already initialized; call destroy_model_parallel() first")
    tp, pp, cp, ep = (tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
                      expert_model_parallel_size)
    _check_sizes(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                 expert_model_parallel_size=ep, expert_tensor_parallel_size=expert_tensor_parallel_size,
                 virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                 num_distributed_optimizer_instances=num_distributed_optimizer_instances)
    _refuse_unsupported(use_sharp, sharp_enabled_group, nccl_communicator_config_path,
                        pipeline_model_parallel_comm_backend)
    timeout = as_timedelta(timeout)
    if not dist.is_initialized():
        init_default_group(backend, timeout)
        STATE["owns_default"] = True
    world_size = dist.get_world_size()
    if world_size % (tp * pp * cp) != 0:
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp} x context_parallel_size {cp} = {tp * pp * cp}")
    if virtual_pipeline_model_parallel_size is not None and pp == 1:
        raise ParallelLayoutError(f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} "
                                  "needs pipeline_model_parallel_size > 1 (the interleaved schedule)")
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    if world_size % (etp * ep * pp) != 0:
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size {etp} x "
            f"expert_model_parallel_size {ep} x pipeline_model_parallel_size {pp} = {etp * ep * pp}")
    dp, edp = world_size // (tp * pp * cp), world_size // (etp * ep * pp)
    instances = num_distributed_optimizer_instances
    if (dp * cp) % instances or edp % instances:
        raise ParallelLayoutError(f"num_distributed_optimizer_instances {instances} divides neither the "
                                  f"data x context parallel size {dp * cp} nor the expert data parallel size {edp}")
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert_gen = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        raise ParallelLayoutError(f"order {order!r} does not end in pp, so the expert data parallel size "
                                  f"({edp}) must equal the data parallel size ({dp})")
    if gen.get_ranks("pp") != expert_gen.get_ranks("pp"):
        raise ParallelLayoutError(f"order {order!r} with these sizes gives the expert layers other pipelines "
                                  "than the dense ones; choose sizes or an order that keep them equal")
    if hierarchical_context_parallel_sizes and math.prod(hierarchical_context_parallel_sizes) != cp:
        raise ParallelLayoutError(f"hierarchical_context_parallel_sizes {hierarchical_context_parallel_sizes} "
                                  f"must multiply to context_parallel_size {cp}")
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        # Before any group exists: NCCL communicators bind to the current device.
        device = select_cuda_device(dist.get_rank())
        warn_if_overlap_unavailable()
    cfgs: dict = {}
    for name in high_priority_stream_groups or []:
        overwrite_nccl_comm_cfgs(cfgs, name, ("is_high_priority_stream", True))
    # A timeout asked for must bound every group: then none reuses the default group.
    maker = GroupMaker(timeout=timeout or datetime.timedelta(minutes=distributed_timeout_minutes),
                       reuse_world=timeout is None and distributed_timeout_minutes == 30)
    try:
        _build(maker, gen, expert_gen, cfgs, instances=instances, hybrid=hybrid_context_parallel,
               hierarchical_cp=hierarchical_context_parallel_sizes, gloo=create_gloo_process_groups,
               all_gather=bool(create_all_gather_group), pp_backend=pipeline_model_parallel_comm_backend,
               embedding_ranks=get_embedding_ranks or default_embedding_ranks,
               position_embedding_ranks=get_position_embedding_ranks or default_position_embedding_ranks)
    except BaseException:
        CREATED.extend(maker.created)
        destroy_model_parallel()  # nothing half-made stays behind
        raise
    CREATED.extend(maker.created)
    STATE.update(rank_generators=(gen, expert_gen), timeout=maker.timeout)
    if virtual_pipeline_model_parallel_size is not None:
        VIRTUAL_PP.update(rank=0, world_size=virtual_pipeline_model_parallel_size)
    STATE["device"] = device


def _build(maker, gen, expert_gen, cfgs, *, instances, hybrid, hierarchical_cp, gloo, all_gather, pp_backend,
           embedding_ranks, position_embedding_ranks) -> None:
    """Create the groups, in the same order on every rank; keep this rank's."""
    rank = dist.get_rank()
    nccl = dist.get_backend() == "nccl"

    def build(kind, rank_lists, *, backend=None, options=None, distinct=False):
        pg_options = get_nccl_options(options or kind, cfgs) if nccl and backend in (None, "nccl") else None
        for ranks in rank_lists:
            group = maker.make(ranks, backend=backend, pg_options=pg_options, desc=kind, distinct=distinct)
            if rank in ranks:
                GROUPS[kind], RANKS[kind] = group, list(ranks)

    def alias(kind, same):
        if same in GROUPS:
            GROUPS[kind], RANKS[kind] = GROUPS[same], RANKS[same]

    def build_with_gloo(kind, rank_lists, options):
        build(kind, rank_lists, options=options)
        if gloo:
            build(f"{kind}_gloo", rank_lists, backend="gloo")

    dp_cp = gen.get_ranks("dp-cp")
    build_with_gloo("dp_cp", dp_cp, "dp_cp")
    if all_gather:
        build("dp_cp_ag", dp_cp, options="dp_cp", distinct=True)
    if instances > 1:
        size = len(dp_cp[0]) // instances
        build_with_gloo("intra_dp_cp", [r[i:i + size] for r in dp_cp for i in range(0, len(r), size)], "intra_dp_cp")
    else:
        alias("intra_dp_cp", "dp_cp")
        alias("intra_dp_cp_gloo", "dp_cp_gloo")
    if hybrid:
        for ranks in dp_cp:
            HYBRID_DP_CP_GROUPS.update(create_hybrid_dp_cp_groups(rank, ranks, None, make=maker.make))
    build_with_gloo("dp", gen.get_ranks("dp"), "dp")
    build("cp", gen.get_ranks("cp"))
    if hierarchical_cp:
        for ranks in gen.get_ranks("cp"):
            mine, _ = create_hierarchical_groups(rank, ranks, hierarchical_cp, make=maker.make, group_desc="hcp")
            if rank in ranks:
                STATE["hierarchical_cp"] = mine
    build("mp", gen.get_ranks("tp-pp"))
    build("tp", gen.get_ranks("tp"))
    pipelines = gen.get_ranks("pp")
    build("pp", pipelines, backend=pp_backend)
    build("embd", [embedding_ranks(r) for r in pipelines])
    build("pos_embd", [position_embedding_ranks(r) for r in pipelines])
    build("tp_dp_cp", gen.get_ranks("tp-dp-cp"))
    build("tp_dp", gen.get_ranks("tp-dp"))
    build("tp_cp", gen.get_ranks("tp-cp"))
    build("ep", expert_gen.get_ranks("ep"))
    build("etp", expert_gen.get_ranks("tp"), options="ep_tp")
    build("tp_ep", expert_gen.get_ranks("tp-ep"), options="tp_ep_mp")
    model_groups = expert_gen.get_ranks("tp-ep-pp")
    build("tp_ep_pp", model_groups)
    expert_dp = expert_gen.get_ranks("dp")
    build_with_gloo("edp", expert_dp, "ep_dp")
    size = len(expert_dp[0]) // instances
    if instances > 1:
        levels = [hierarchical_rank_groups(ranks, [size, instances]) for ranks in expert_dp]
        build_with_gloo("intra_edp", [g for per in levels for g in per[0]], "intra_ep_dp")
        build("inter_edp", [g for per in levels for g in per[1]], options="inter_ep_dp")
    else:
        alias("intra_edp", "edp")
        alias("intra_edp_gloo", "edp_gloo")
    # An optimizer instance: `size` consecutive expert model-parallel groups.
    build("intra_dist_opt", [sum(model_groups[i:i + size], []) for i in range(0, len(model_groups), size)],
          options="intra_dist_opt_instance")


def created_groups() -> list[dist.ProcessGroup]:
    """The process groups initialize_model_parallel created on this rank (reused ones excluded)."""
    return list(CREATED)


def update_pg_timeout(timeout: datetime.timedelta, pg=None) -> None:
    """Set the collective timeout of ``pg``, or of the default group and every group tensorpar made."""
    dist.barrier(pg)
    for group in [pg] if pg is not None else [None, *CREATED]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _plain_maker(timeout):
    def make(ranks, *, backend=None, pg_options=None, desc=None):
        return create_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=desc)
    return make


def create_hierarchical_groups(rank, ranks, hierarchical_group_sizes, create_gloo_process_groups=False,
                               pg_options=None, timeout=None, group_desc=None, *, make=None):
    """This rank's group at each level of ``ranks`` split by ``hierarchical_group_sizes`` (and
    the gloo twins, or Nones); every rank must call it."""
    make = make or _plain_maker(timeout)
    options = pg_options if isinstance(pg_options, list) else [pg_options] * len(hierarchical_group_sizes)
    mine, mine_gloo = [], []
    for level, groups in enumerate(hierarchical_rank_groups(list(ranks), hierarchical_group_sizes)):
        for sub in groups:
            group = make(sub, pg_options=options[level], desc=group_desc)
            group_gloo = make(sub, backend="gloo", desc=group_desc) if create_gloo_process_groups else None
            if rank in sub:
                mine.append(group)
                mine_gloo.append(group_gloo)
    return mine, mine_gloo


def create_hybrid_dp_cp_groups(rank, ranks, pg_options, *, make=None):
    """``{size: this rank's group}`` for each power of two from 2 below ``len(ranks)``."""
    make = make or _plain_maker(None)
    if len(ranks) % 2:
        raise ParallelLayoutError(f"hybrid_context_parallel needs an even data x context parallel size, got {len(ranks)}")
    groups = {}
    for size in [2 ** i for i in range(int(math.log2(len(ranks))))][1:]:
        for start in range(0, len(ranks), size):
            group = make(ranks[start:start + size], pg_options=pg_options, desc=f"hybrid_dp_cp_{size}")
            if rank in ranks[start:start + size]:
                groups[size] = group
    return groups


def is_initialized() -> bool:
    """Whether the data-parallel group exists (code that runs with or without model parallel)."""
    return "dp" in GROUPS


def is_unitialized() -> bool:
    """Deprecated (as in Megatron): ``not is_initialized()``."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2)
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    return all(kind in GROUPS for kind in ("tp", "pp", "dp"))


def create_all_gather_groups(for_expert_parallelism: bool = False, timeout=None, nccl_comm_cfgs=None):
    """Megatron's (core 0.19): communicators of their own over this rank's DP x CP ranks and,
    with ``for_expert_parallelism`` and EP > 1, its expert-DP ranks, for all-gathers that overlap
    the reduce-scatters on the usual ones: ``(dp_cp_ag, expt_dp_ag)``, None where none is made.
    Every rank calls it, after :func:`initialize_model_parallel`; :func:`destroy_model_parallel`
    frees them. ``timeout`` (default the groups' own) and ``nccl_comm_cfgs`` as there."""
    if STATE.get("rank_generators") is None:
        raise RuntimeError("create_all_gather_groups() needs initialize_model_parallel() first")
    gen, expert_gen = STATE["rank_generators"]
    maker = GroupMaker(timeout=as_timedelta(timeout) or STATE["timeout"], reuse_world=False)
    nccl = dist.get_backend() == "nccl"

    def communicators(rank_lists, options: str, desc: str):
        pg_options = get_nccl_options(options, nccl_comm_cfgs or {}) if nccl else None
        groups = [(ranks, maker.make(ranks, pg_options=pg_options, desc=desc, distinct=True)) for ranks in rank_lists]
        return next(group for ranks, group in groups if dist.get_rank() in ranks)

    try:
        dp_cp_ag = communicators(gen.get_ranks("dp-cp"), "dp_cp", "dp_cp_ag")
        expt_dp_ag = communicators(expert_gen.get_ranks("dp"), "ep_dp", "expt_dp_ag") \
            if for_expert_parallelism and expert_gen.ep > 1 else None
    finally:
        CREATED.extend(maker.created)
    return dp_cp_ag, expt_dp_ag


def destroy_model_parallel() -> None:
    """Forget every group and override; also tears down the default group if tensorpar created it."""
    if dist.is_initialized():
        for group in CREATED:
            dist.destroy_process_group(group)
    for state in (GROUPS, RANKS, HYBRID_DP_CP_GROUPS, OVERRIDES):
        state.clear()
    CREATED.clear()
    VIRTUAL_PP.update(rank=None, world_size=None)
    STATE.update(hierarchical_cp=None, device=None, rank_generators=None, timeout=None)
    if STATE["owns_default"] and dist.is_initialized():
        dist.destroy_process_group()
    STATE["owns_default"] = False


