"""Megatron-core's ``parallel_state``: tensor, pipeline, context, data and expert groups.

``initialize_model_parallel`` takes megatron-core 0.16.1's arguments and lays the ranks out as
Megatron does (:class:`~tensorpar.distributed.rank_generator.RankGenerator`, ``order="tp-cp-ep-dp-pp"`` by
default: TP groups are blocks of consecutive ranks, so a TP group stays inside one node when
``torchrun`` places consecutive ranks on a node). With world size 8, TP=2 and PP=2: TP groups
{0,1} {2,3} {4,5} {6,7}, DP groups {0,2} {1,3} {4,6} {5,7}, PP groups {0,4} {1,5} {2,6} {3,7}.
The getters below read this rank's groups; the ``set_*`` overrides answer for the world sizes
and ranks without groups (Megatron's "fake" initialisation for single-process layer tests).

Example::

    import tensorpar as tp
    tp.initialize_model_parallel(2)          # reads RANK/WORLD_SIZE/MASTER_* from torchrun
    tp.get_tensor_model_parallel_rank()      # 0 or 1
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from .distributed.parallel_init import (
    create_all_gather_groups, create_hierarchical_groups, create_hybrid_dp_cp_groups, created_groups,
    destroy_model_parallel,
    initialize_model_parallel, is_initialized, is_unitialized, model_parallel_is_initialized, update_pg_timeout)
from .distributed.parallel_registry import (
    GROUPS, HYBRID_DP_CP_GROUPS, OVERRIDES, RANKS, STATE, VIRTUAL_PP, default_device, distributed, group, ranks,
    require_initialized, resolve_ep_group, resolve_tp_group)
from .distributed.process_groups import create_group, get_nccl_options, overwrite_nccl_comm_cfgs, select_cuda_device  # noqa: F401
from .distributed.rank_generator import (
    ParallelLayoutError, RankGenerator, default_embedding_ranks, default_position_embedding_ranks,
    generate_masked_orthogonal_rank_groups)


def _overridden(kind: str, read):
    """The ``set_*`` override of ``kind`` if one is set, else ``read()``."""
    value = OVERRIDES.get(kind)
    return value if value is not None else read()


def _size_or_zero(kind: str) -> int:
    """Megatron's convention: 0 when torch.distributed is not initialized."""
    return group(kind).size() if distributed() else 0


def _rank_or_zero(kind: str) -> int:
    return group(kind).rank() if distributed() else 0


# Groups.

def get_model_parallel_group(check_initialized=True):
    """This rank's TP x PP group."""
    return group("mp", check_initialized)


def get_tensor_model_parallel_group(check_initialized=True):
    """This rank's TP group; with ``check_initialized=False``, ``None`` before initialisation (as Megatron)."""
    if check_initialized:
        require_initialized("get_tensor_model_parallel_group()")
    return GROUPS.get("tp")


def get_pipeline_model_parallel_group(check_initialized=True):
    return group("pp", check_initialized)


def get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False, independent_all_gather=False):
    """This rank's DP group; with ``with_context_parallel`` the DP x CP group the gradients are
    reduced over (``partial_data_parallel``: within one optimizer instance; ``independent_all_gather``:
    the second communicator of ``create_all_gather_group``)."""
    if not with_context_parallel:
        if partial_data_parallel:
            raise ValueError("get_data_parallel_group: partial_data_parallel=True needs with_context_parallel=True")
        return group("dp")
    if partial_data_parallel:
        return group("intra_dp_cp")
    return group("dp_cp_ag" if independent_all_gather else "dp_cp")


def has_separate_all_gather_group() -> bool:
    """Whether ``create_all_gather_group=True`` made a second DP x CP communicator."""
    return "dp_cp_ag" in GROUPS


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """The gloo twin of :func:`get_data_parallel_group` (the same group when the backend is gloo)."""
    if not with_context_parallel:
        if partial_data_parallel:
            raise ValueError("get_data_parallel_group_gloo: partial_data_parallel=True needs with_context_parallel=True")
        return group("dp_gloo")
    return group("intra_dp_cp_gloo" if partial_data_parallel else "dp_cp_gloo")


def get_context_parallel_group(check_initialized=True):
    return group("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized=True):
    return ranks("cp") if check_initialized or "cp" in GROUPS else None


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's group per level of ``hierarchical_context_parallel_sizes``."""
    if check_initialized and STATE["hierarchical_cp"] is None:
        raise RuntimeError("no hierarchical context parallel groups: pass hierarchical_context_parallel_sizes= "
                           "to initialize_model_parallel")
    return STATE["hierarchical_cp"]


def get_hybrid_data_context_parallel_groups(check_initialized=True, group_size=None):
    """The DP x CP sub-group of ``group_size`` ranks made by ``hybrid_context_parallel=True``."""
    if get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return group("dp_cp", check_initialized)
    if group_size not in HYBRID_DP_CP_GROUPS:
        raise RuntimeError(f"no hybrid DP x CP group of {group_size} ranks (made: {sorted(HYBRID_DP_CP_GROUPS)}); "
                           "pass hybrid_context_parallel=True to initialize_model_parallel")
    return HYBRID_DP_CP_GROUPS[group_size]


def get_embedding_group(check_initialized=True):
    """The first and last stages of this rank's pipeline (they hold the tied word embedding)."""
    return group("embd", check_initialized)


def get_position_embedding_group(check_initialized=True):
    return group("pos_embd", check_initialized)


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The FP8 amax reduction group: TP x DP (x CP), or TP (x CP) with ``tp_only_amax_red``."""
    if tp_only_amax_red:
        return group("tp_cp" if with_context_parallel else "tp")
    return group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    return group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized=True):
    return group("tp_cp", check_initialized)


def get_expert_model_parallel_group(check_initialized=True):
    return group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized=True):
    return group("etp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    return group("tp_ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True):
    return group("tp_ep_pp", check_initialized)


def get_expert_data_parallel_group(check_initialized=True, partial_expert_data_parallel=False):
    return group("intra_edp" if partial_expert_data_parallel else "edp", check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel=False):
    """Deprecated (as in Megatron): :func:`get_expert_data_parallel_group`."""
    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, please use "
                  "get_expert_data_parallel_group instead.", DeprecationWarning, stacklevel=2)
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    return group("intra_edp_gloo" if partial_expert_data_parallel else "edp_gloo")


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    return group("intra_dist_opt", check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """Across optimizer instances (``num_distributed_optimizer_instances > 1`` only)."""
    return group("inter_edp", check_initialized)


# World sizes and ranks, with Megatron's overrides.

def set_tensor_model_parallel_world_size(world_size):
    OVERRIDES["tp_size"] = world_size


def set_pipeline_model_parallel_world_size(world_size):
    OVERRIDES["pp_size"] = world_size


def set_virtual_pipeline_model_parallel_world_size(world_size):
    VIRTUAL_PP["world_size"] = world_size


def set_tensor_model_parallel_rank(rank):
    OVERRIDES["tp_rank"] = rank


def set_pipeline_model_parallel_rank(rank):
    OVERRIDES["pp_rank"] = rank


def set_data_parallel_rank(rank):
    OVERRIDES["dp_rank"] = rank


def set_expert_model_parallel_world_size(world_size):
    OVERRIDES["ep_size"] = world_size


def set_expert_model_parallel_rank(rank):
    OVERRIDES["ep_rank"] = rank


def set_expert_tensor_parallel_world_size(world_size):
    OVERRIDES["etp_size"] = world_size


def set_expert_tensor_parallel_rank(rank):
    OVERRIDES["etp_rank"] = rank


def set_virtual_pipeline_model_parallel_rank(rank):
    """Deprecated (as in Megatron): pass ``vp_stage=`` to the stage predicates instead."""
    warnings.warn("set_virtual_pipeline_model_parallel_rank in global scope is deprecated. Pass vp_stage "
                  "explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.", DeprecationWarning,
                  stacklevel=2)
    VIRTUAL_PP["rank"] = rank


def get_tensor_model_parallel_world_size() -> int:
    return _overridden("tp_size", lambda: get_tensor_model_parallel_group().size())


def get_tensor_model_parallel_rank() -> int:
    return _overridden("tp_rank", lambda: get_tensor_model_parallel_group().rank())


def get_pipeline_model_parallel_world_size() -> int:
    return _overridden("pp_size", lambda: group("pp").size())


def get_pipeline_model_parallel_rank() -> int:
    return _overridden("pp_rank", lambda: group("pp").rank())


def get_virtual_pipeline_model_parallel_rank():
    return VIRTUAL_PP["rank"]


def get_virtual_pipeline_model_parallel_world_size():
    return VIRTUAL_PP["world_size"]


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False) -> int:
    """0 when torch.distributed is not initialized (as Megatron)."""
    if not distributed():
        return 0
    return get_data_parallel_group(with_context_parallel, partial_data_parallel).size()


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False) -> int:
    if OVERRIDES.get("dp_rank") is not None:
        return OVERRIDES["dp_rank"]
    if not distributed():
        return 0
    return get_data_parallel_group(with_context_parallel, partial_data_parallel).rank()


def get_context_parallel_world_size() -> int:
    return _size_or_zero("cp")


def get_context_parallel_rank() -> int:
    return _rank_or_zero("cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size_or_zero("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _rank_or_zero("tp_cp")


def get_expert_model_parallel_world_size() -> int:
    return _overridden("ep_size", lambda: _size_or_zero("ep"))


def get_expert_model_parallel_rank() -> int:
    return _overridden("ep_rank", lambda: _rank_or_zero("ep"))


def get_expert_tensor_parallel_world_size():
    """The ETP size; without an ETP group, the TP size override (as Megatron)."""
    return _overridden("etp_size", lambda: group("etp").size() if "etp" in GROUPS else OVERRIDES.get("tp_size"))


def get_expert_tensor_parallel_rank():
    return _overridden("etp_rank", lambda: group("etp").rank() if "etp" in GROUPS else OVERRIDES.get("tp_rank"))


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size_or_zero("tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank_or_zero("tp_ep")


def get_expert_data_parallel_rank(partial_expert_data_parallel=False) -> int:
    return _rank_or_zero("intra_edp" if partial_expert_data_parallel else "edp")


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False) -> int:
    return _size_or_zero("intra_edp" if partial_expert_data_parallel else "edp")


# Pipeline stages.

def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None) -> bool:
    """Whether this rank runs the first pipeline stage; with ``ignore_virtual=False`` and
    virtual pipelining, also whether ``vp_stage`` is its first model chunk."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        if vp_stage is None:
            raise ValueError("is_pipeline_first_stage: pass vp_stage= when virtual pipelining is on")
        if vp_stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None) -> bool:
    """Whether this rank runs the last pipeline stage (and ``vp_stage`` its last chunk, see
    :func:`is_pipeline_first_stage`)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None:
        if vp_stage is None:
            raise ValueError("is_pipeline_last_stage: pass vp_stage= when virtual pipelining is on")
        if vp_stage != vpp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None) -> bool:
    """Whether this rank is in its embedding group (and, not ignoring virtual stages, holds the
    embedding in chunk ``vp_stage``)."""
    members = RANKS.get("embd")
    rank = dist.get_rank()
    if members is None or rank not in members:
        return False
    if ignore_virtual:
        return True
    if rank == members[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == members[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    members = RANKS.get("pos_embd")
    return members is not None and dist.get_rank() in members


# Global ranks.

def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (the broadcast source for a TP group)."""
    require_initialized("get_tensor_model_parallel_src_rank()")
    return RANKS["tp"][0]


def get_tensor_model_parallel_global_ranks() -> list[int]:
    require_initialized("get_tensor_model_parallel_global_ranks()")
    return list(RANKS["tp"])


def get_data_parallel_global_ranks(with_context_parallel=False) -> list[int]:
    return list(ranks("dp_cp" if with_context_parallel else "dp"))


def get_model_parallel_src_rank() -> int:
    return ranks("mp")[0]


def get_data_parallel_src_rank(with_context_parallel=False) -> int:
    return ranks("dp_cp" if with_context_parallel else "dp")[0]


def get_expert_model_parallel_src_rank() -> int:
    return ranks("ep")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return ranks("pp")[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (the first after the last)."""
    stage, stages = get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size()
    return ranks("pp")[(stage + 1) % stages]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (the last before the first)."""
    stage, stages = get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size()
    return ranks("pp")[(stage - 1) % stages]


def get_all_ranks() -> str:
    """``"tp_dp_cp_pp_ep"``: this rank's coordinates, joined by underscores."""
    coordinates = [get_tensor_model_parallel_rank(), get_data_parallel_rank(), get_context_parallel_rank(),
                   get_pipeline_model_parallel_rank(), get_expert_model_parallel_rank()]
    return "_".join(str(c or 0) for c in coordinates)


def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
    """``tp_group``, or this rank's (expert) tensor-parallel group when it is None (megatron.core.utils')."""
    if tp_group is not None:
        return tp_group
    if is_expert:
        return get_expert_tensor_parallel_group(check_initialized)
    return get_tensor_model_parallel_group(check_initialized)


# Megatron's module globals, which some Megatron code reads directly: this rank's group (None
# before initialisation) or its global ranks, read-only, from the groups the getters above read.
_MEGATRON_GROUP_GLOBALS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp", "_PIPELINE_MODEL_PARALLEL_GROUP": "pp", "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embd", "_POSITION_EMBEDDING_GROUP": "pos_embd", "_CONTEXT_PARALLEL_GROUP": "cp",
    "_DATA_PARALLEL_GROUP": "dp", "_DATA_PARALLEL_GROUP_GLOO": "dp_gloo",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp_gloo",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": "dp_cp_ag",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra_dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "intra_dp_cp_gloo",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp", "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep", "_EXPERT_TENSOR_PARALLEL_GROUP": "etp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "edp", "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "edp_gloo",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "intra_edp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "intra_edp_gloo",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "inter_edp",
}
_MEGATRON_RANKS_GLOBALS = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp", "_PIPELINE_GLOBAL_RANKS": "pp", "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_EMBEDDING_GLOBAL_RANKS": "embd", "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp", "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp", "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
}


def __getattr__(name: str):
    if name in _MEGATRON_GROUP_GLOBALS:
        return GROUPS.get(_MEGATRON_GROUP_GLOBALS[name])
    if name in _MEGATRON_RANKS_GLOBALS:
        held = RANKS.get(_MEGATRON_RANKS_GLOBALS[name])
        return None if held is None else list(held)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
