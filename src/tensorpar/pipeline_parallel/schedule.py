"""One of torch's pipeline schedules over this rank's stages, stepping exactly as PP=1's
gradient accumulation does.

PP=1 accumulates ``M`` micro-batches as ``(loss_k / M).backward()``, ``loss_k`` the mean over
micro-batch ``k``'s labelled tokens, and reports the mean of the ``loss_k``. Here torch's
schedule runs the same micro-batches (the batch's rows cut into ``M`` equal parts), the last
stage's loss function returns ``loss_k / M`` (torch's own grad scaling is off), and after the
schedule the gradients are finished as PP=1's are: the SP partial sums over TP, and the tied
embedding's two copies (first and last stage) summed over the embedding group. ``step``
returns the mean micro-batch loss, broadcast to every rank of the pipeline. Stages built over a
CP group run each CP rank's chunks of every micro-batch: what passes between stages is those
chunks, and the last stage's loss is the mean over the whole sequence (every CP rank's tokens).

With ``tp_invariant=True`` each micro-batch's gradient is taken apart and handed on in
micro-batch order (:class:`~.microbatch_grads.MicroBatchGrads`): to ``grad_sink`` (a
``DataParallelGradReducer(micro_batches=)``'s ``add_grad``: PP=1's fixed tree), or added into
``.grad``; the tied embedding's two copies are summed per micro-batch, as PP=1's autograd does.
Stages sharded by FSDP (:func:`~.stages.fully_shard_stages`) hand each backward's gradients to
``sharded_grads`` (a ``ShardedGradSync(micro_batches=)``: PP=1's tree over FSDP's shards), a
tied embedding's to :class:`~.tied_grads.ShardedTiedGrads`, which adds the two copies' per
micro-batch first.
The schedules that split the backward (:func:`~.plan.check_invariant`) are refused.

Example::

    schedule = PipelineSchedule(stages, layout, schedule="1f1b", microbatches=4, pp_group=pp_group)
    loss = schedule.step(tokens, labels)        # the same tokens and labels on every rank
    optimizer.step()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..distributed import comm
from ..errors import UsageError
from ..data_parallel.fsdp import is_fully_sharded
from ..data_parallel.grads import allreduce_sequence_parallel_grads
from ..models import GPT, context_split
from .microbatch_grads import MicroBatchGrads
from .plan import StageLayout, check_invariant, check_microbatches, schedule_spec
from .tied_grads import ShardedTiedGrads
from .torch_stage import TorchStage


class PipelineSchedule:
    """``schedule`` (a name of :data:`tensorpar.pipeline_parallel.SCHEDULES`) over ``stages`` (this rank's,
    from :func:`build_stages` with ``layout``), ``microbatches`` micro-batches per step.

    ``embedding_group`` (the ranks of the first and last stage, per TP rank, as Megatron's
    embedding group) is needed with tied embeddings when those stages are on different ranks.
    ``loss_divisor`` is what each micro-batch's loss is divided by before its backward (default
    ``microbatches``; the invariant mode's training loop: the global count, ``microbatches x DP``;
    under CP, whose reducer averages over DP x CP: ``microbatches / CP``).
    In the invariant mode, create a ``DataParallelGradReducer`` after the schedule.
    """

    def __init__(self, stages: list[GPT], layout: StageLayout, *, schedule: str, microbatches: int, pp_group,
                 embedding_group=None, loss_divisor: float | None = None) -> None:
        spec = schedule_spec(schedule)
        check_microbatches(schedule, microbatches=microbatches, pp_size=layout.pp_size,
                           virtual_stages=None if spec.placement == "single" else len(stages))
        self.invariant = stages[0].config.tp_invariant
        sharded = is_fully_sharded(stages[0])
        if self.invariant:
            check_invariant(schedule)
            if any(hasattr(p, "main_grad") for m in stages for p in m.parameters()):
                raise UsageError("tp_invariant pipeline: create the DataParallelGradReducer after the "
                                 "PipelineSchedule (the schedule takes each micro-batch's gradient first)")
        self.loss_divisor = microbatches if loss_divisor is None else loss_divisor
        rank = comm.group_rank(pp_group)
        self.indices = layout.stages_of(rank)
        if len(stages) != len(self.indices):
            raise UsageError(f"PP rank {rank} holds stages {list(self.indices)} of the layout, got {len(stages)} modules")
        self.stages, self.layout, self.microbatches, self.pp_group = stages, layout, microbatches, pp_group
        self.last = layout.num_stages - 1
        config = stages[0].config
        self.tied = config.tie_word_embeddings and layout.num_stages > 1
        holds_a_copy = 0 in self.indices or self.last in self.indices
        if self.tied and holds_a_copy and layout.rank_of(0) != layout.rank_of(self.last) and embedding_group is None:
            raise UsageError("tied embeddings with the first and last stage on different ranks need the "
                             "embedding group (embedding_group=)")
        self.embedding_group = embedding_group
        device = next(stages[0].parameters()).device
        pipeline_stages = [TorchStage(module, index, layout.num_stages, device, group=pp_group)
                           for module, index in zip(stages, self.indices)]
        self._last_stage = pipeline_stages[-1]
        self._torch_stages = pipeline_stages
        tied = [m.embedding.word.weight for m in stages if m.pre_process and self.tied] + \
               [m.lm_head.weight for m in stages if m.post_process and self.tied and not m.pre_process]
        self._grads = MicroBatchGrads(pipeline_stages, microbatches=microbatches, tied=tied,
                                      embedding_group=embedding_group) if self.invariant and not sharded else None
        context = stages[0].parallel.context
        self._tied_grads = ShardedTiedGrads(tied, microbatches=microbatches, embedding_group=embedding_group,
                                            cp_group=None if context is None else context.group) \
            if self.invariant and sharded and tied else None
        self._losses: list[torch.Tensor] = []
        self._schedule = spec.torch_class(pipeline_stages[0] if spec.placement == "single" else pipeline_stages,
                                          microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The last stage's logits [b, s, V/TP] cover the sequence as padded for SP (under CP this
        # rank's chunks of it): so do the labels.
        labels = context_split.shard_labels(self.stages[-1].parallel.context, labels)
        labels = F.pad(labels, (0, logits.shape[1] - labels.shape[1]), value=-100)
        loss = self.stages[-1].loss(logits.transpose(0, 1), labels)
        if not self._last_stage.inferring:
            self._losses.append(loss.detach())
        return loss / self.loss_divisor

    def step(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of ``tokens`` and ``labels`` (``[B, s]``, ``B`` a multiple of the
        micro-batch count; only the first and the last stage's ranks read them): gradients
        accumulate in ``.grad``; returns the mean micro-batch loss (float64, every rank)."""
        return self.microbatch_losses(tokens, labels).mean()

    def microbatch_losses(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                          backward: bool = True, grad_sink=None, sharded_grads=None,
                          first_micro_batch: int = 0) -> torch.Tensor:
        """Each micro-batch's mean loss ``[M]`` (float64, every rank of the pipeline), after a
        forward and backward as :meth:`step`'s, or with ``backward=False`` a forward only
        (an evaluation: no gradient is touched). In the invariant mode: ``grad_sink(param, grad)``
        gets each micro-batch's gradients in order (default: summed into ``.grad``), under FSDP
        ``sharded_grads`` (a ``ShardedGradSync(micro_batches=)``) each backward's, and the
        dropout masks of micro-batch ``k`` are keyed by ``first_micro_batch + k``. Under context
        parallelism every rank passes ``tokens`` or ``labels``: each stage reads the sequence length."""
        for name, batch in (("tokens", tokens), ("labels", labels)):
            if batch is not None and batch.shape[0] % self.microbatches:
                raise UsageError(f"a batch of {batch.shape[0]} {name} rows does not cut into "
                                 f"{self.microbatches} equal micro-batches")
        kwargs = {}  # what torch's schedule hands every stage's forward
        if self.stages[0].parallel.context is not None:
            given = tokens if tokens is not None else labels
            if given is None:
                raise UsageError("a pipeline under context parallelism needs the tokens or labels on every rank: "
                                 "each stage reads the sequence length whose chunks it runs")
            kwargs["sequence_length"] = given.shape[1]
        self._losses.clear()
        args = (tokens,) if 0 in self.indices else ()
        target = labels if self.last in self.indices else None
        for stage in self._torch_stages:
            stage.first_micro_batch, stage.sharded_grads = first_micro_batch, sharded_grads
            stage.tied_grads = self._tied_grads if sharded_grads is not None else None
        if self._grads is not None:
            self._grads.sink = grad_sink
        if backward:
            self._schedule.step(*args, target=target, return_outputs=False, **kwargs)
            self._finish_grads()
        else:
            with torch.no_grad():
                self._schedule.eval(*args, target=target, **kwargs)
        device = comm.collective_device(self.pp_group)
        losses = torch.zeros(self.microbatches, dtype=torch.float64, device=device)
        if self._losses:
            losses.copy_(torch.stack(self._losses).double())
        holder = dist.get_global_rank(self.pp_group, self.layout.rank_of(self.last))
        return comm.broadcast(losses, holder, self.pp_group)

    def _finish_grads(self) -> None:
        if self._grads is not None:  # first: with a reducer, its DP sums come before the SP sums, as at PP=1
            self._grads.finish()
        # Under FSDP the invariant mode sums the tied copies itself only given its ShardedGradSync.
        tied_summed = self._grads is not None or self._torch_stages[0].tied_grads is not None
        if self._torch_stages[0].tied_grads is not None:
            self._tied_grads.finish()
        for module in self.stages:
            allreduce_sequence_parallel_grads(module, tp_group=module.tp_group)
        if not self.tied or tied_summed or self.layout.rank_of(0) == self.layout.rank_of(self.last):
            return  # untied, summed per micro-batch, or (V schedules) one parameter on one rank
        copies = [m.embedding.word.weight for m in self.stages if m.pre_process] + \
                 [m.lm_head.weight for m in self.stages if m.post_process]
        # The training loop's DataParallelGradReducer keeps the gradients in main_grad.
        grads = [w.main_grad if hasattr(w, "main_grad") else w.grad for w in copies]
        if grads and grads[0] is not None:
            # Under FSDP each copy is sharded alike over its stage's DP group: the shards add up.
            comm.all_reduce(grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0], self.embedding_group)
