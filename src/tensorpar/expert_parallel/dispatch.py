"""Token dispatch: each (token, choice) row to the rank holding its expert, and back.

Dropless: every row is computed. Over the expert-parallel group the rows move by two
all-to-alls each way: first the counts (how many rows each rank sends to each of the receiver's
experts), then the rows themselves, uneven. A rank that sends or receives nothing takes part
with empty slices.

Layouts (T tokens, k choices each, E experts over EP ranks)::

    tokens [T, h] ──repeat k, sort by expert──> rows [T k, h] (expert order)
      ──all-to-all──> received [R, h] (by source rank, then expert) ──regroup──> [R, h] by local expert
    and back: regroup⁻¹, all-to-all, sort⁻¹, weighted sum of each token's k rows

Every step is a permutation or a fixed-order sum, so the gradients are deterministic.
"""

from __future__ import annotations

import dataclasses

import torch

from ..distributed import comm
from ..tensor_parallel.mappings import all_to_all


@dataclasses.dataclass
class Routed:
    """What :func:`combine` needs to bring the rows of one :func:`dispatch` back."""

    choices: tuple[int, int]             # (T, k)
    order: torch.Tensor                  # rows of the T k choices, in expert order
    sent: list[int] | None = None        # rows to each EP rank
    received: list[int] | None = None    # rows from each EP rank
    regroup: torch.Tensor | None = None  # received rows in local-expert order
    row_keys: torch.Tensor | None = None  # the rows' tokens' keys (dispatch's keys=), in the rows' order


def inverse_permutation(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(len(permutation), device=permutation.device)
    return inverse


def dispatch(tokens: torch.Tensor, experts: torch.Tensor, *, num_experts: int, ep_group=None,
             keys: torch.Tensor | None = None):
    """``(rows, rows_per_local_expert, routed)``: the rows for this rank's experts, grouped by
    local expert, their counts (``[E/EP]``), and the state :func:`combine` takes back.
    ``keys`` (``[T]`` integers) travel with each token's rows: ``routed.row_keys``."""
    num_tokens, k = experts.shape
    hidden = tokens.shape[-1]
    order = torch.argsort(experts.reshape(-1), stable=True)
    rows = tokens.unsqueeze(1).expand(num_tokens, k, hidden).reshape(num_tokens * k, hidden).index_select(0, order)
    row_keys = None if keys is None else keys.repeat_interleave(k).index_select(0, order)
    rows_per_expert = torch.bincount(experts.reshape(-1), minlength=num_experts)
    ep_size = 1 if ep_group is None else comm.group_size(ep_group)
    if ep_size == 1:
        return rows, rows_per_expert, Routed((num_tokens, k), order, row_keys=row_keys)
    local = num_experts // ep_size
    sending = rows_per_expert.view(ep_size, local)
    receiving = comm.all_to_all(sending.contiguous(), ep_group)            # [EP, E/EP]: row i from rank i
    sent, received = sending.sum(1).tolist(), receiving.sum(1).tolist()
    arrived = all_to_all(ep_group, rows, received, sent)
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep_size).repeat_interleave(receiving.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    if row_keys is not None:
        row_keys = comm.all_to_all(row_keys, ep_group, output_split_sizes=received,
                                   input_split_sizes=sent).index_select(0, regroup)
    return arrived.index_select(0, regroup), receiving.sum(0), Routed((num_tokens, k), order, sent, received, regroup,
                                                                      row_keys)


def combine(rows: torch.Tensor, weights: torch.Tensor, routed: Routed, *, ep_group=None) -> torch.Tensor:
    """Each token's output ``[T, h]``: its k experts' rows, weighted by ``weights`` ``[T, k]``."""
    if routed.regroup is not None:
        rows = all_to_all(ep_group, rows.index_select(0, inverse_permutation(routed.regroup)), routed.sent, routed.received)
    num_tokens, k = routed.choices
    per_choice = rows.index_select(0, inverse_permutation(routed.order)).view(num_tokens, k, rows.shape[-1])
    weights = weights.to(per_choice.dtype)
    out = per_choice[:, 0] * weights[:, :1]
    for choice in range(1, k):  # in choice order, one add at a time: a token's sum whatever the rows around it
        out = out + per_choice[:, choice] * weights[:, choice:choice + 1]
    return out
