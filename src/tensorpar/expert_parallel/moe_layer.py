"""The mixture-of-experts layer: a block's MLP replaced by routed experts (and shared ones).

Input and output are a block's ``[s, b, h]`` activations as the dense MLP takes them: this rank's
sequence shard under SP, or the whole sequence replicated over TP without it, in which case
each TP rank routes its own 1/TP of the tokens and the outputs are gathered back. The experts
are never split by TP; they are sharded over ``ep_group``, any group of ranks holding different
tokens (Megatron's folding of EP over TP x CP x DP). Shared experts (a dense TP-split MLP the
caller builds) see every token.

Gradients: the router's weight, like a LayerNorm's under SP, is partial on each rank that
routes its own tokens (``sequence_parallel`` set when they are split over TP); the experts'
weights are marked ``allreduce = False`` and are summed over the expert-data-parallel group.

Example::

    moe = MoELayer(512, num_experts=8, ffn_hidden_size=1024, topk=2, ep_group=ep_group)
    y = moe(x)                                   # x [s, b, h]
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import comm
from ..tensor_parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from .dispatch import combine, dispatch
from .experts import GroupedExperts
from .router import TopKRouter


@torch.compiler.disable
def _eager(fn, *args):
    """``fn(*args)`` outside a compiled graph: the routed rows' counts change every step (a graph
    would recompile each time) and travel by all-to-alls of data-dependent sizes."""
    return fn(*args)


def _even_sizes(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


class MoELayer(nn.Module):
    """Router, token dispatch over ``ep_group``, :class:`GroupedExperts`, and ``shared_experts``.

    ``router_options`` go to :class:`TopKRouter` (``score_function``, ``load_balancing_type``,
    ``aux_loss_coeff``, ``enable_expert_bias``, ...). ``tp_group`` and ``sequence_parallel`` say
    how the input is placed over TP; ``cp_group`` which ranks hold the sequence's other chunks.
    """

    router_type = TopKRouter

    def __init__(self, hidden_size: int, *, num_experts: int, ffn_hidden_size: int, topk: int,
                 ep_group=None, tp_group=None, cp_group=None, sequence_parallel: bool = False,
                 shared_experts: nn.Module | None = None, init_method=None, output_init_method=None,
                 params_dtype=torch.float32, device=None, **router_options) -> None:
        super().__init__()
        self.tp_group, self.ep_group = tp_group, ep_group
        self.tp_size, self.tp_rank = (1, 0) if tp_group is None else \
            (comm.group_size(tp_group), comm.group_rank(tp_group))
        # Without SP every TP rank holds every token: each routes its own 1/TP of them.
        self.split_tokens = self.tp_size > 1 and not sequence_parallel
        tokens_split = self.tp_size > 1
        stats_groups = [g for g, split in ((tp_group, tokens_split), (cp_group, True))
                        if split and g is not None and comm.group_size(g) > 1]
        self.router = self.router_type(hidden_size, num_experts, topk=topk, stats_groups=stats_groups,
                                       init_method=init_method, dtype=params_dtype, device=device, **router_options)
        self.router.weight.sequence_parallel = tokens_split
        self.experts = GroupedExperts(num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                                      ep_group=ep_group, init_method=init_method,
                                      output_init_method=output_init_method, params_dtype=params_dtype, device=device)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens, first = x.reshape(s * b, h), 0
        if self.split_tokens:
            sizes = _even_sizes(s * b, self.tp_size)
            tokens = scatter_to_sequence_parallel_region(tokens, self.tp_group, sizes=sizes)
            first = sum(sizes[:self.tp_rank])
        sequence_of_token = torch.arange(first, first + len(tokens), device=x.device) % b  # [s, b] flattened
        weights, experts = self.router(tokens, sequence_of_token, b)
        out = _eager(self.routed, tokens, weights, experts)
        if self.split_tokens:
            out = gather_from_sequence_parallel_region(out, False, self.tp_group, sizes=sizes)
        out = out.view(s, b, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def routed(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each token's output ``[T, h]``: its rows to their experts' ranks, through them, and back."""
        rows, rows_per_expert, routed = dispatch(tokens, experts, num_experts=self.router.num_experts,
                                                 ep_group=self.ep_group)
        return combine(self.experts(rows, rows_per_expert), weights, routed, ep_group=self.ep_group)
