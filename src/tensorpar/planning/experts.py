"""What an MoE layer's token dispatch sends over its expert-parallel group, per rank and step.

Each rank dispatches its ``T`` tokens' ``k`` choices: forward, an all-to-all of the counts
(``[EP, E/EP]`` int64: how many rows go to each of every rank's experts), one of the rows there
(``[T k, h]``) and one of the expert outputs back; backward, the two row exchanges again,
reversed. Under balanced routing (every expert ``T k / E`` rows of every rank) each row
exchange's input is ``[T k, h]`` on every rank, and ``(EP - 1) / EP`` of it leaves the rank.

Example::

    dispatch_collectives(tokens=4096, hidden=4096, topk=2, num_experts=8, ep=4, dtype=torch.bfloat16)
"""

from __future__ import annotations

import torch

from .communication import GroupOp

LAYER = "moe"


def dispatch_collectives(*, tokens: int, hidden: int, topk: int, num_experts: int, ep: int,
                         dtype: torch.dtype, tp: int = 1) -> list[GroupOp]:
    """The collectives of one MoE layer's forward and backward on a rank routing ``tokens``
    tokens (none at ``ep`` 1), under balanced routing; ``tp`` only labels the step."""
    if ep == 1:
        return []
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split evenly over EP {ep}")
    rows = (tokens * topk, hidden)

    def op(phase, kind, shape, what, op_dtype=dtype):
        return GroupOp(LAYER, phase, "all_to_all", shape, op_dtype, tp, what, None, group="ep", size=ep)

    return [op("forward", "counts", (ep, num_experts // ep), "rows per expert, to each rank", torch.int64),
            op("forward", "rows", rows, "token rows to their experts' ranks"),
            op("forward", "rows", rows, "expert outputs back"),
            op("backward", "rows", rows, "output grads to the experts' ranks"),
            op("backward", "rows", rows, "row grads back")]
