"""How balanced a run's experts are, step by step: the balance losses and the expert load.

Once per optimizer step, after it, :meth:`ExpertBalance.finish_step` moves the routers' expert
biases from the whole global batch's counts (:func:`tensorpar.expert_parallel.step_expert_balance`)
and returns what the log shows: the balance losses (auxiliary and z-loss, summed over the MoE
layers, averaged over the step's micro-batches) and the load imbalance (the most tokens an
expert received over the mean, the worst layer's).

Example::

    balance = ExpertBalance(model, groups=(tp_group, cp_group, dp_group))
    for batch in micro_batches:
        loss(batch).backward()
    optimizer.step()
    aux_loss, imbalance = balance.finish_step(micro_batches=len(micro_batches) * dp_size)
"""

from __future__ import annotations

import torch

from ..distributed import comm
from ..expert_parallel import TopKRouter, step_expert_balance


class ExpertBalance:
    """The MoE figures of ``model``'s steps; ``groups``: the ranks holding the global batch's
    other tokens (TP, CP, DP; None where there is no such axis); ``pp_group``: the ranks holding
    the other pipeline stages' layers."""

    def __init__(self, model: torch.nn.Module, *, groups, pp_group=None) -> None:
        self.model, self.groups = model, [g for g in groups if g is not None and comm.group_size(g) > 1]
        self.pp_group = pp_group if pp_group is not None and comm.group_size(pp_group) > 1 else None
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]

    def finish_step(self, *, micro_batches: int) -> torch.Tensor:
        """``[aux loss, load imbalance]`` of the step (every rank's micro-batches, ``micro_batches``
        of them), on the device; the expert biases moved and the counts cleared."""
        # This rank's parts of the step's balance losses, summed over its MoE layers (read before the reset).
        aux_loss = torch.stack([router.aux_loss_sum for router in self.routers]).sum()
        loads = step_expert_balance(self.model, groups=self.groups)
        for group in self.groups:
            comm.all_reduce(aux_loss, group)
        imbalance = torch.stack([load.max() / load.mean().clamp(min=1) for load in loads]).max()
        if self.pp_group is not None:  # every stage's MoE layers
            comm.all_reduce(aux_loss, self.pp_group)
            comm.all_reduce(imbalance, self.pp_group, op="max")
        return torch.stack([aux_loss / micro_batches, imbalance.double()])


def experts_words(config, ep_size: int) -> str:
    """The header's words for a model's experts: how many, where, and how they are balanced."""
    balance = [f"aux loss x{config.moe_aux_loss_coeff:g}" if config.moe_aux_loss_coeff else "",
               "expert bias" if config.moe_router_enable_expert_bias else ""]
    balance = " and ".join(b for b in balance if b) or "no balancing"
    return (f"{config.num_moe_experts} experts (top {config.moe_router_topk}) over EP={ep_size}, "
            f"{config.num_moe_experts // ep_size} a rank, balanced by {balance}")
