"""The top-k router: which experts each token goes to, with what weight, and how balance is kept.

Scores are ``softmax`` (Mixtral, Qwen) or ``sigmoid`` (DeepSeek-V3) of the router's logits, in
fp32. Grouped routing (DeepSeek-V3) first keeps the ``group_topk`` best of ``num_groups`` expert
groups, a group scored by the sum of its two best experts. The chosen experts' scores are the
token's weights: renormalised over the top k (``pre_softmax=False``; always for sigmoid with
k > 1), then times ``scaling_factor``.

Balance, both ways:

* an auxiliary loss (Switch Transformer's ``E * sum_e f_e * P_e``, with ``f_e`` the share of the
  routed tokens that went to expert ``e`` and ``P_e`` its mean score) over the micro-batch of
  this data rank (``"aux_loss"``: the tokens its TP and CP ranks split) or over each sequence
  (``"seq_aux_loss"``), and a z-loss on the logits. Both enter backward through the routing
  weights (:func:`attach_aux_loss`), scaled as the main loss is (:func:`set_aux_loss_scale`);
* the auxiliary-loss-free expert bias: added to the scores for the choice only, moved by
  ``bias_update_rate`` towards balance once per optimizer step from the whole global batch's
  counts (:func:`step_expert_balance`).

Example::

    router = TopKRouter(512, 8, topk=2, aux_loss_coeff=1e-2)
    weights, experts = router(tokens)           # tokens [T, h] -> [T, k] each
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")


class _AuxLossScale:
    value = 1.0


def set_aux_loss_scale(scale: float) -> None:
    """The factor the auxiliary losses' gradients get: what the main loss is multiplied by
    before backward (``1 / micro-batches`` under gradient accumulation)."""
    _AuxLossScale.value = float(scale)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; backward also starts the auxiliary loss's backward."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, _AuxLossScale.value)


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``output``, whose backward also differentiates ``aux_loss`` (Megatron's auto-scaler): the
    loss needs no place in the model's returned loss, so a pipeline stage without the head works."""
    if not aux_loss.requires_grad:
        return output
    return _AttachAuxLoss.apply(output, aux_loss)


class _LogSumExp(torch.autograd.Function):
    """``logsumexp`` over the last dim, whose gradient is the row's softmax: a kernel per row,
    where torch's (``exp`` of the whole tensor) rounds an element by where it falls in it."""

    @staticmethod
    def forward(ctx, logits):
        ctx.save_for_backward(logits)
        return torch.logsumexp(logits, -1)

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        return grad.unsqueeze(-1) * logits.softmax(-1)


class _Counting:
    paused = False


@contextlib.contextmanager
def counts_paused():
    """Forwards that are no training step's count no tokens and no balance loss (a pipeline's
    shape inference on a dummy micro-batch)."""
    paused, _Counting.paused = _Counting.paused, True
    try:
        yield
    finally:
        _Counting.paused = paused


def _counted() -> bool:
    # A recomputed forward runs inside backward: its tokens were counted by the first forward.
    return not _Counting.paused and torch._C._current_graph_task_id() == -1


def _sum_over(tensor: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        if group is not None and comm.group_size(group) > 1:
            tensor = comm.all_reduce(tensor, group)
    return tensor


class TopKRouter(nn.Module):
    """Scores ``num_experts`` experts for every token and picks ``topk`` of them.

    ``forward(tokens [T, h], sequence_of_token [T] = None, num_sequences=1)`` returns
    ``(weights [T, k], experts [T, k])``, this rank's part of the balance losses attached to
    ``weights`` (:func:`attach_aux_loss`: their backward starts its backward); ``aux_loss_sum`` and
    ``tokens_per_expert`` add up the training forwards' (not a recompute's) until
    :func:`step_expert_balance`. ``seq_aux_loss`` needs each token's sequence, of ``num_sequences``.
    ``stats_groups``: the groups whose ranks hold the other tokens of this rank's micro-batch
    (TP when it splits the tokens, CP), over which the balance statistics are summed.
    """

    def __init__(self, hidden_size: int, num_experts: int, *, topk: int, score_function: str = "softmax",
                 pre_softmax: bool = False, num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, load_balancing_type: str = "aux_loss",
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, enable_expert_bias: bool = False,
                 bias_update_rate: float = 1e-3, stats_groups=(), init_method=None, dtype=torch.float32,
                 device=None) -> None:
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
        if load_balancing_type not in LOAD_BALANCING:
            raise ValueError(f"load_balancing_type must be one of {LOAD_BALANCING}, got {load_balancing_type!r}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
        if (num_groups is None) != (group_topk is None):
            raise ValueError("grouped routing needs both num_groups and group_topk")
        if num_groups is not None and (num_experts % num_groups or not 1 <= group_topk <= num_groups
                                       or topk > group_topk * (num_experts // num_groups)):
            raise ValueError(f"grouped routing: {num_experts} experts in {num_groups} groups, keeping "
                             f"{group_topk}, cannot choose {topk}")
        self.num_experts, self.topk, self.score_function = num_experts, topk, score_function
        self.pre_softmax, self.num_groups, self.group_topk = pre_softmax, num_groups, group_topk
        self.scaling_factor, self.load_balancing_type = scaling_factor, load_balancing_type
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.bias_update_rate, self.stats_groups = bias_update_rate, tuple(stats_groups)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        (init_method or functools.partial(nn.init.normal_, std=0.02))(self.weight)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device) if enable_expert_bias else None)
        # Tokens each expert received since the last optimizer step (this rank's): the bias update and the logs.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float64, device=device),
                             persistent=False)
        # This rank's part of the balance losses, summed over the training forwards since the last step (the logs).
        self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float64, device=device), persistent=False)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The router's fp32 logits ``[T, E]`` of ``tokens`` ``[T, h]``."""
        return F.linear(tokens, self.weight).float()

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(-1) if self.score_function == "softmax" else logits.sigmoid()

    def forward(self, tokens: torch.Tensor, sequence_of_token: torch.Tensor | None = None, num_sequences: int = 1):
        logits = self.logits(tokens)                                         # [T, E]
        scores = self.scores(logits)
        choice = scores.detach()
        if self.expert_bias is not None:
            choice = choice + self.expert_bias
        if self.num_groups is not None:
            choice = self._keep_best_groups(choice)
        experts = choice.topk(self.topk, dim=-1).indices                     # [T, k]
        weights = scores.gather(-1, experts)
        if (self.score_function == "softmax" and not self.pre_softmax) or (
                self.score_function == "sigmoid" and self.topk > 1):
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling_factor is not None:
            weights = weights * self.scaling_factor
        counts = torch.zeros(tokens.shape[0], self.num_experts, device=tokens.device).scatter_(1, experts, 1.0)
        balance_loss = self._loss(logits, scores, counts, sequence_of_token, num_sequences)
        if self.training and _counted():
            self.tokens_per_expert += counts.sum(0, dtype=torch.float64)
            self.aux_loss_sum += balance_loss.detach().double()
        return attach_aux_loss(weights, balance_loss), experts

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        grouped = choice.unflatten(-1, (self.num_groups, -1))                # [T, groups, E/groups]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        kept = group_scores.topk(self.group_topk, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).flatten(-2)

    def _loss(self, logits, scores, counts, sequence_of_token, num_sequences) -> torch.Tensor:
        """This rank's part of the balance losses: summed over ``stats_groups`` it is the loss."""
        loss = logits.new_zeros(())
        if self.training and self.aux_loss_coeff > 0 and self.load_balancing_type != "none":
            probs = scores if self.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
            if self.load_balancing_type == "seq_aux_loss":
                if sequence_of_token is None:
                    raise ValueError("load_balancing_type='seq_aux_loss' needs each token's sequence")
                owner, owners = sequence_of_token, num_sequences
            else:
                owner, owners = torch.zeros(len(probs), dtype=torch.long, device=probs.device), 1
            loss = loss + self._switch_loss(probs, counts, owner, owners)
        if self.training and self.z_loss_coeff > 0:
            total = _sum_over(logits.new_tensor(float(len(logits))), self.stats_groups)
            loss = loss + self.z_loss_coeff * _LogSumExp.apply(logits).square().sum() / total
        return loss

    def _switch_loss(self, probs: torch.Tensor, counts: torch.Tensor, owner: torch.Tensor,
                     owners: int) -> torch.Tensor:
        """The Switch loss of each owner of tokens (the micro-batch, or each sequence), averaged
        over the owners; an owner's counts and token total are summed over ``stats_groups``."""
        one_hot = F.one_hot(owner, owners).to(probs.dtype).t()               # [owners, T]
        owner_counts = _sum_over(one_hot @ counts, self.stats_groups)        # [owners, E]
        owner_probs = one_hot @ probs                                        # [owners, E], this rank's tokens
        tokens = (owner_counts.sum(-1) / self.topk).clamp(min=1)
        per_owner = (owner_probs * owner_counts).sum(-1) * self.num_experts / (self.topk * tokens.square())
        return self.aux_loss_coeff * per_owner.mean()


@torch.no_grad()
def step_expert_balance(model: nn.Module, *, groups=()) -> list[torch.Tensor]:
    """After an optimizer step: every router's tokens per expert since the last one, summed over
    ``groups`` (the ranks holding the global batch's other tokens: DP, CP, TP), returned (one
    ``[E]`` tensor per router, in module order) and cleared, with the balance losses' sums; each
    expert bias moved by its rate towards the mean count (up for an expert below it, down above).
    The same on every rank."""
    loads = []
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        counts = _sum_over(router.tokens_per_expert.clone(), groups)
        if router.expert_bias is not None:
            router.expert_bias += router.bias_update_rate * torch.sign(counts.mean() - counts).float()
        router.tokens_per_expert.zero_()
        router.aux_loss_sum.zero_()
        loads.append(counts)
    return loads
