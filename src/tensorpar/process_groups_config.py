"""Megatron-core's ``process_groups_config``: ``ProcessGroupCollection``, the process groups a
module uses, handed to it (Megatron's ``pg_collection=``) instead of read from ``parallel_state``.

Megatron's field names, all of them: a field never set reads None. Its weight-rematerialisation
groups (``*gtp_remat*``) have no counterpart here: ``use_mpu_process_groups`` gives the groups
without rematerialisation for the ``*_gtp_remat`` fields, and None for ``gtp_remat`` and
``expt_gtp_remat``. The all-gather twins ``dp_cp_ag`` and ``expt_dp_ag`` start as None, as in
Megatron, for the caller to set.

Example::

    from tensorpar.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "dp_cp"])
    groups.tp.size(), groups.pp        # pp: None, not asked for
"""

from __future__ import annotations

import functools

from . import parallel_state as ps

__all__ = ["ProcessGroupCollection"]


def _unset() -> None:
    return None


def _initialized_groups() -> dict:
    """Each field's group from the initialized ``parallel_state`` (a function each: only the
    asked-for ones are read)."""
    expert_tp_ep_pp = functools.partial(ps.get_expert_tensor_model_pipeline_parallel_group, check_initialized=False)
    dp_cp = functools.partial(ps.get_data_parallel_group, with_context_parallel=True)
    expert_dp = functools.partial(ps.get_expert_data_parallel_group, check_initialized=False)
    return {
        "tp": functools.partial(ps.get_tensor_model_parallel_group, check_initialized=False),
        "pp": functools.partial(ps.get_pipeline_model_parallel_group, check_initialized=False),
        "mp": functools.partial(ps.get_model_parallel_group, check_initialized=False),
        "embd": functools.partial(ps.get_embedding_group, check_initialized=False),
        "pos_embd": functools.partial(ps.get_position_embedding_group, check_initialized=False),
        "cp": functools.partial(ps.get_context_parallel_group, check_initialized=False),
        "tp_cp": functools.partial(ps.get_tensor_and_context_parallel_group, check_initialized=False),
        "hcp": functools.partial(ps.get_hierarchical_context_parallel_groups, check_initialized=False),
        "ep": functools.partial(ps.get_expert_model_parallel_group, check_initialized=False),
        "expt_tp": functools.partial(ps.get_expert_tensor_parallel_group, check_initialized=False),
        "tp_ep": functools.partial(ps.get_expert_tensor_and_model_parallel_group, check_initialized=False),
        "tp_ep_pp": expert_tp_ep_pp,
        "tp_ep_pp_with_egtp_remat": expert_tp_ep_pp,
        "tp_dp_cp": functools.partial(ps.get_tensor_and_data_parallel_group, check_initialized=False,
                                      with_context_parallel=True),
        "dp": ps.get_data_parallel_group,
        "dp_cp": dp_cp,
        "dp_cp_gtp_remat": dp_cp,
        "dp_cp_ag": _unset,
        "gtp_remat": _unset,
        "expt_gtp_remat": _unset,
        "expt_dp": expert_dp,
        "expt_dp_gtp_remat": expert_dp,
        "expt_dp_ag": _unset,
        "intra_dp_cp": functools.partial(ps.get_data_parallel_group, with_context_parallel=True,
                                         partial_data_parallel=True),
        "intra_expt_dp": functools.partial(ps.get_expert_data_parallel_group, check_initialized=False,
                                           partial_expert_data_parallel=True),
        "inter_dist_opt": functools.partial(ps.get_inter_distributed_optimizer_instance_group,
                                            check_initialized=False),
        "intra_dist_opt": functools.partial(ps.get_intra_distributed_optimizer_instance_group,
                                            check_initialized=False),
    }


FIELDS = tuple(_initialized_groups())


class ProcessGroupCollection:
    """Process groups by Megatron's field names (``tp``, ``pp``, ``dp_cp``, ``ep``, ``expt_dp``,
    ...: :data:`FIELDS`); ``ProcessGroupCollection(tp=group, ...)`` sets some, the rest read None.
    An unknown name is refused (ValueError)."""

    def __init__(self, **groups) -> None:
        for name, group in groups.items():
            setattr(self, name, group)

    def __setattr__(self, name: str, value) -> None:
        if name not in FIELDS:
            raise ValueError(f"Unknown attribute: {name}")
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        if name in FIELDS:  # (only reached for a field never set)
            return None
        raise AttributeError(f"'ProcessGroupCollection' object has no attribute '{name}'")

    def __repr__(self) -> str:
        sizes = [f"{name}({[g.size() for g in group] if isinstance(group, list) else group.size()})"
                 for name in FIELDS if (group := vars(self).get(name)) is not None]
        return f"ProcessGroupCollection({', '.join(sizes) or 'empty'})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> "ProcessGroupCollection":
        """The groups of the initialized ``parallel_state``: ``required_pgs`` of them (default all)."""
        getters = _initialized_groups()
        required = list(FIELDS) if required_pgs is None else list(required_pgs)
        invalid = [name for name in required if name not in getters]
        if invalid:
            raise ValueError(f"Invalid process groups requested: {invalid}")
        return cls(**{name: getters[name]() for name in required})
