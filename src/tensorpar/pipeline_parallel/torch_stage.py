"""torch's ``PipelineStage`` as tensorpar runs it: its sends and receives recorded in every
active :class:`~tensorpar.CommLedger`, and its shape inference kept out of the gradients.

torch's schedules issue the point-to-point ops a stage hands them (``get_fwd_send_ops`` and
the like); this stage records each one as it hands it over, as a ``send`` or ``recv`` record.
Stages on the same rank (the V schedules' turn) pass tensors by function call: nothing is
sent, nothing recorded. The shape-inference messages of a schedule's first step are objects,
not tensors, and are not recorded.

That first step also runs each stage forward and backward once on a dummy micro-batch, to
learn the shapes. Its backward asks autograd for the input gradients only, but a recomputed
block (:func:`tensorpar.checkpoint`) runs its own backward inside and adds to its parameters'
gradients (under a DataParallelGradReducer, its ``main_grad``): parameters with a ``main_grad``
need no gradient while it runs, the others' ``.grad`` is set aside. ``inferring`` is True meanwhile, so the loss function can tell the dummy
micro-batch from the real ones; routers count neither pass (:func:`tensorpar.expert_parallel.counts_paused`).

Each forward and backward records the schedule's micro-batch id (``microbatch``). In the
invariant mode a forward sets its GPT's dropout counter to ``first_micro_batch`` plus that id,
so micro-batch ``k``'s masks are PP=1's, whatever order the schedule runs them in; under FSDP
(``sharded_grads``, a ``ShardedGradSync(micro_batches=)``) each backward's gradients go into
its trees as that micro-batch's, where torch's stage would leave them unreduced until the
step's end (a tied embedding's first to ``tied_grads``, a :class:`~.tied_grads.ShardedTiedGrads`).

The zero-bubble schedules' weight backward (``interleaved-zb``, ``zbv``, ``dualpipev``) sets
each ``.grad`` itself, past the post-accumulate-grad hook by which a DataParallelGradReducer
moves it into ``main_grad``: the stage moves it there, as the hook would.

torch's ``eval`` runs a schedule's own actions with the backward ones turned into no-ops, but
the V schedules still hand each (absent) input gradient to the stage below on the same rank,
which torch's stage refuses without a backward: in a forward-only pass that hand-off is
nothing, so every schedule evaluates through torch's ``eval``.

Example::

    stage = TorchStage(module, stage_index, num_stages, device, group=pp_group)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from ..distributed import comm
from ..errors import UsageError
from ..expert_parallel import counts_paused


def require_torch_pipelining() -> None:
    """Refuse, in one line, a torch whose ``PipelineStage`` is not the one this stage extends.

    The stage hooks torch 2.13's backward shape inference (``_backward_metadata_inference``);
    torch 2.11's stage has none and its schedules' first step differs. Everything else in
    tensorpar runs on the older torch, so the check waits until a stage is built.
    """
    if not hasattr(PipelineStage, "_backward_metadata_inference"):
        raise UsageError(f"pipeline parallelism needs torch 2.13 or newer (its PipelineStage's backward shape "
                         f"inference); this is torch {torch.__version__}")


def _recorded(ops: list[dist.P2POp]) -> list[dist.P2POp]:
    for op in ops:
        comm.record_p2p("send" if op.op is dist.isend else "recv", op.tensor)
    return ops


class TorchStage(PipelineStage):
    """A ``PipelineStage`` whose P2P ops are recorded, whose shape inference leaves the
    gradients alone, whose weight backward reaches ``main_grad``, and which runs torch's
    forward-only ``eval`` under every schedule."""

    inferring = False
    microbatch = 0          # the schedule's id of the micro-batch in forward or backward
    first_micro_batch = 0   # the global index of the step's micro-batch 0 (the invariant mode's masks)
    sharded_grads = None    # the invariant mode under FSDP: the ShardedGradSync each backward's gradients go to
    tied_grads = None       # and the ShardedTiedGrads that takes a tied embedding's out first

    def __init__(self, *args, **kwargs):
        require_torch_pipelining()
        super().__init__(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self.microbatch = fwd_chunk_id
        if self.submod.dropout_masks is not None:
            self.submod.dropout_masks.counter = self.first_micro_batch + fwd_chunk_id
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self.microbatch = bwd_chunk_id
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if self.sharded_grads is not None and not self.inferring:
            if self.tied_grads is not None:
                self.tied_grads.take(self.submod, micro_batch=self.microbatch)
            self.sharded_grads.reduce_micro_batch(self.submod, self.microbatch)
        return result

    def _forward_metadata_inference(self, *args, **kwargs):
        with counts_paused():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        params = list(self.submod.parameters())
        kept = [param.grad for param in params]
        self.inferring = True
        try:
            with self._main_grads_frozen(), counts_paused():
                return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            self.inferring = False
            for param, grad in zip(params, kept):
                param.grad = grad

    @contextlib.contextmanager
    def _main_grads_frozen(self):
        """The parameters with a ``main_grad`` (a DataParallelGradReducer's) need no gradient
        meanwhile: a recomputed block's forward records none for them and the reducer's hook sees
        no ``.grad``, so their ``main_grad`` needs no copy set aside."""
        frozen = [param for param in self.submod.parameters() if param.requires_grad and hasattr(param, "main_grad")]
        for param in frozen:
            param.requires_grad_(False)
        try:
            yield
        finally:
            for param in frozen:
                param.requires_grad_(True)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        for param in self.submod.parameters():
            if param.grad is not None and hasattr(param, "main_grad"):
                param.main_grad.add_(param.grad)
                param.grad = None

    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return _recorded(super().get_fwd_send_ops(fwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return _recorded(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return _recorded(super().get_bwd_send_ops(bwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return _recorded(super().get_bwd_recv_ops(bwd_chunk_id))
