"""torch's ``PipelineStage`` with its activation and gradient sends and receives recorded in
every active :class:`~tensorpar.CommLedger`, as ``send`` and ``recv`` records.

torch's schedules issue the point-to-point ops a stage hands them (``get_fwd_send_ops`` and
the like); this stage records each one as it hands it over. Stages on the same rank (the V
schedules' turn) pass tensors by function call: nothing is sent, nothing recorded. The
shape-inference messages of a schedule's first step are objects, not tensors, and are not
recorded.

Example::

    stage = RecordedStage(module, stage_index, num_stages, device, group=pp_group)
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from .. import comm


def _recorded(ops: list[dist.P2POp]) -> list[dist.P2POp]:
    for op in ops:
        comm.record_p2p("send" if op.op is dist.isend else "recv", op.tensor)
    return ops


class RecordedStage(PipelineStage):
    """A ``PipelineStage`` whose P2P ops are recorded in the active ledgers."""

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return _recorded(super().get_fwd_send_ops(fwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return _recorded(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return _recorded(super().get_bwd_send_ops(bwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return _recorded(super().get_bwd_recv_ops(bwd_chunk_id))
