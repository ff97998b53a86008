"""Mixture of experts with expert parallelism: router, routed experts, token dispatch.

See ``MOE_DESIGN.md`` beside this file for how the experts, tokens and gradients are placed.
"""

from .dispatch import combine, dispatch
from .experts import GroupedExperts
from .moe_layer import MoELayer
from .router import TopKRouter, attach_aux_loss, counts_paused, set_aux_loss_scale, step_expert_balance

__all__ = ["GroupedExperts", "MoELayer", "TopKRouter", "attach_aux_loss", "combine", "counts_paused", "dispatch",
           "set_aux_loss_scale", "step_expert_balance"]
