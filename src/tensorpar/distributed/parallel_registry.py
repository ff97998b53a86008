"""Where this rank's process groups live once ``initialize_model_parallel`` made them.

One dictionary per fact, keyed by the group's kind (``"tp"``, ``"pp"``, ``"dp_cp"``, ...):
:mod:`tensorpar.distributed.parallel_init` fills them, :mod:`tensorpar.parallel_state` reads them.

Example::

    from tensorpar.distributed.parallel_registry import group
    group("tp")      # this rank's TP group, or a clear error before initialisation
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# This rank's group (and its global ranks) per kind.
GROUPS: dict[str, dist.ProcessGroup] = {}
RANKS: dict[str, list[int]] = {}
HYBRID_DP_CP_GROUPS: dict[int, dist.ProcessGroup] = {}
# The groups initialize_model_parallel created (destroyed by destroy_model_parallel).
CREATED: list[dist.ProcessGroup] = []
# Megatron's set_* overrides ("fake" initialisation for layer tests): kind -> value.
OVERRIDES: dict[str, int | None] = {}
VIRTUAL_PP: dict[str, int | None] = {"rank": None, "world_size": None}
# owns_default: tensorpar created the default group; device: the backend's device;
# hierarchical_cp: this rank's group per level of hierarchical context parallelism.
STATE: dict = {"owns_default": False, "device": None, "hierarchical_cp": None, "rank_generators": None,
               "timeout": None}

NAMES = {"tp": "tensor model parallel", "pp": "pipeline model parallel", "dp": "data parallel",
         "dp_cp": "data parallel (with context parallel)", "cp": "context parallel", "mp": "model parallel",
         "embd": "embedding", "pos_embd": "position embedding", "tp_dp": "tensor and data parallel",
         "tp_dp_cp": "tensor and data parallel (with context parallel)", "tp_cp": "tensor and context parallel",
         "ep": "expert model parallel", "etp": "expert tensor parallel",
         "tp_ep": "expert tensor and model parallel", "tp_ep_pp": "expert tensor-model-pipeline parallel",
         "edp": "expert data parallel", "intra_edp": "intra partial expert data parallel",
         "inter_edp": "inter distributed optimizer instance", "intra_dist_opt": "intra distributed optimizer instance",
         "dp_gloo": "data parallel gloo", "dp_cp_gloo": "data parallel gloo (with context parallel)",
         "intra_dp_cp": "intra partial data parallel", "intra_dp_cp_gloo": "intra partial data parallel gloo",
         "edp_gloo": "expert data parallel gloo", "intra_edp_gloo": "intra partial expert data parallel gloo",
         "dp_cp_ag": "data parallel all-gather (with context parallel)"}


def group(kind: str, check_initialized: bool = True):
    """This rank's group of ``kind``; None (``check_initialized=False``) or an error if absent."""
    found = GROUPS.get(kind)
    if found is None and check_initialized:
        raise RuntimeError(f"the {NAMES[kind]} group is not initialized: call "
                           "tensorpar.initialize_model_parallel(...) first")
    return found


def ranks(kind: str) -> list[int]:
    """The global ranks of this rank's group of ``kind``."""
    group(kind)
    return RANKS[kind]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def require_initialized(what: str) -> None:
    if "tp" not in GROUPS:
        raise RuntimeError(f"{what} needs tensorpar model parallel: call "
                           "tensorpar.initialize_model_parallel(...) first, or pass tp_group=")


def resolve_tp_group(tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The explicit group if given, else the initialized TP group (clear error if neither)."""
    if tp_group is not None:
        return tp_group
    require_initialized("this tensorpar layer or mapping")
    return GROUPS["tp"]


def resolve_ep_group(ep_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The explicit group if given, else the initialized expert-parallel group, whose experts
    must not be split by TP (tensorpar's experts are whole on each rank)."""
    if ep_group is not None:
        return ep_group
    require_initialized("a mixture-of-experts layer")
    if dist.get_world_size(GROUPS["etp"]) > 1:
        raise ValueError(f"tensorpar's experts are not split by tensor parallelism: initialize_model_parallel("
                         f"expert_tensor_parallel_size=1), got {dist.get_world_size(GROUPS['etp'])}")
    return GROUPS["ep"]


def default_device() -> torch.device:
    """Where layers put their parameters when ``device=None``: the backend's device."""
    if STATE["device"] is not None:
        return STATE["device"]
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
