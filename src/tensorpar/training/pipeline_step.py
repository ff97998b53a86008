"""``tensorpar train --pp N``: this rank's pipeline stages as one module the training loop steps,
evaluates and checkpoints as it does a GPT.

The stages (:func:`tensorpar.pipeline_parallel.build_stages`) carry the PP=1 model's weights; their
parameters are named as the PP=1 model names them (a stage's ``blocks.0`` is ``blocks.3`` when
the stage starts at layer 3; the last stage's copy of a tied embedding is ``embedding.word.weight``),
so checkpoints are the same files at every PP size. A step runs the step's micro-batches (the
gradient accumulation) through the schedule; the DP reduction of every stage waits for the
schedule's end (``sync=False`` while it runs, then ``finish()``), after the schedule has summed
the SP and tied-embedding gradients: all sums, in any order the same gradient. Under FSDP
(``fsdp_group=``) torch's stages reduce-scatter each stage's gradients after its last
micro-batch instead, averaging over DP as the reducer does. In the invariant mode
(:mod:`.invariant_batches`) each micro-batch's loss is divided by the global micro-batch
count, its gradients go into the reducer's tree in micro-batch order (``add_grad``; a stage's
DP reduction runs once its last micro-batch's are in; under FSDP each backward's into the
``ShardedGradSync``'s trees over the shards) and its dropout masks are keyed by its global
index, all as at PP=1.

Example::

    model = PipelinedGPT(config, schedule="1f1b", microbatches=4, virtual_stages=None, device=device)
    loss_sum = model.train_step(sampler.micro_batches(step), reducer=reducer, dtype="fp32")
    model.header   # 'pipeline 1f1b, stage 0 (PP rank 0): layers 0-1, ..., predicted bubble 20%'
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import comm
from .. import parallel_state as ps
from ..data_parallel.fsdp import MIN_UNIT_MIB, ShardedGradSync
from ..invariant.dropout import MaskCounter
from ..models import GPTConfig
from ..pipeline_parallel import PipelineSchedule, StageLayout, build_stages, full_model_name, fully_shard_stages, stage_layout
from ..planning.pipeline import bubble_fraction
from .context_run import ContextLayout
from .data import BatchSampler
from .evaluation import autocast


def pipeline_header(layout: StageLayout, *, schedule: str, microbatches: int, virtual_stages: int | None) -> str:
    """The run header's line: the schedule, the stage layout and the predicted bubble, e.g.
    ``pipeline 1f1b, stage 0 (PP rank 0): layers 0-1, stage 1 (PP rank 1): layers 2-3, predicted bubble 20%``."""
    bubble, _ = bubble_fraction(schedule, pp_size=layout.pp_size, microbatches=microbatches,
                                virtual_stages=virtual_stages)
    predicted = f"predicted bubble {100 * bubble:.0f}%" if bubble is not None else f"bubble not modelled for {schedule}"
    return f"pipeline {schedule}, {layout.describe()}, {predicted}"


def _stacked(micro_batches, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``[(tokens, labels)]`` in one batch, which the schedule cuts back into them."""
    tokens, labels = zip(*micro_batches)
    return torch.cat(tokens).to(device), torch.cat(labels).to(device)


class PipelinedGPT(nn.Module):
    """This PP rank's stages of a GPT and the schedule that runs them, ``microbatches`` per step.

    ``named_parameters`` gives the PP=1 names (each parameter once); ``num_parameters`` is the
    whole model's count (the unpadded TP=1 model's, as ``count_parameters`` gives at PP=1).
    Given ``fsdp_group`` (the DP group, or DP x CP), each stage is sharded over it
    (:func:`tensorpar.pipeline_parallel.fully_shard_stages`, in units of ``min_unit_mib``); given a
    ``context`` of CP > 1, every stage runs its CP rank's chunks of each sequence.
    """

    def __init__(self, config: GPTConfig, *, schedule: str, microbatches: int, virtual_stages: int | None,
                 device, fsdp_group=None, min_unit_mib: float = MIN_UNIT_MIB,
                 context: ContextLayout | None = None) -> None:
        super().__init__()
        pp_group, tp_group = ps.get_pipeline_model_parallel_group(), ps.get_tensor_model_parallel_group()
        self.config, self.tp_group, self.pp_group = config, tp_group, pp_group
        self.layout = stage_layout(config.num_layers, pp_size=comm.group_size(pp_group), schedule=schedule,
                                   virtual_stages=virtual_stages)
        stages = build_stages(config, self.layout, pp_group=pp_group, tp_group=tp_group,
                              cp_group=None if context is None else context.group, device=device)
        self.stages = nn.ModuleList(stages if fsdp_group is None else fully_shard_stages(
            stages, dp_group=fsdp_group, min_unit_mib=min_unit_mib))
        ends = {self.layout.rank_of(0), self.layout.rank_of(self.layout.num_stages - 1)}
        embedding_group = ps.get_embedding_group() if comm.group_rank(pp_group) in ends and len(ends) > 1 else None
        # The invariant mode: one division by the global micro-batch count, at any DP size, as at PP=1;
        # else the reducer's average over CP undone (ContextLayout.loss_scale).
        loss_divisor = microbatches * comm.group_size(ps.get_data_parallel_group()) if config.tp_invariant \
            else microbatches / (1 if context is None else context.loss_scale)
        self.schedule = PipelineSchedule(list(self.stages), self.layout, schedule=schedule,
                                         microbatches=microbatches, pp_group=pp_group,
                                         embedding_group=embedding_group, loss_divisor=loss_divisor)
        # The training loop sets its counter to the global index of the step's first micro-batch.
        self.dropout_masks = MaskCounter(seed=self.stages[0].dropout_masks.seed) if config.tp_invariant else None
        self.num_parameters = self._count()
        self.header = pipeline_header(self.layout, schedule=schedule, microbatches=microbatches,
                                      virtual_stages=virtual_stages)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen = set()
        for stage in self.stages:
            for name, param in stage.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield prefix + full_model_name(stage, name), param

    def _count(self) -> int:
        tp = comm.group_size(self.tp_group)
        ep = comm.group_size(ps.get_expert_model_parallel_group()) if self.config.num_moe_experts else 1
        total = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else
                                 ep if getattr(p, "expert_parallel", False) else 1)
                    for p in self.parameters() if not getattr(p, "shared", False))
        count = torch.tensor(float(total), dtype=torch.float64, device=comm.collective_device(self.pp_group))
        comm.all_reduce(count, self.pp_group)
        padding = self.stages[0].padded_vocab_size - self.config.vocab_size
        heads = 1 if self.config.tie_word_embeddings else 2  # the embedding, and an untied LM head
        return int(count.item()) - padding * self.config.hidden_size * heads

    def train_step(self, micro_batches, *, reducer, dtype: str) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (``[(tokens, labels)]``, as many as the
        schedule's); returns their mean losses ``[M]`` (float64, every rank)."""
        device = next(self.parameters()).device
        tokens, labels = _stacked(micro_batches, device)
        reducer.sync = False  # every stage's DP reduction waits for the schedule's end: reducer.finish()
        invariant = self.dropout_masks is not None
        sharded = isinstance(reducer, ShardedGradSync)
        with autocast(dtype, device):
            return self.schedule.microbatch_losses(
                tokens, labels, grad_sink=reducer.add_grad if invariant and not sharded else None,
                sharded_grads=reducer if invariant and sharded else None,
                first_micro_batch=self.dropout_masks.counter if invariant else 0)

    def losses(self, batches, *, dtype: str) -> list[torch.Tensor]:
        """The mean loss of each of ``batches`` (``[(tokens, labels)]``, any number), forward only
        through the schedule, ``M`` at a time (the last group filled up with repeats, not returned)."""
        device = next(self.parameters()).device
        m, out = self.schedule.microbatches, []
        for first in range(0, len(batches), m):
            group = [batches[min(i, len(batches) - 1)] for i in range(first, first + m)]
            tokens, labels = _stacked(group, device)
            with autocast(dtype, device):
                out.extend(self.schedule.microbatch_losses(tokens, labels, backward=False).unbind()[:len(batches) - first])
        return out


@torch.no_grad()
def evaluate(model: PipelinedGPT, sampler: BatchSampler, *, iters: int, dtype: str, device, dp_group) -> float:
    """:func:`tensorpar.training.evaluation.evaluate` through the pipeline: the same ``iters``
    batches, run forward ``M`` at a time (:meth:`PipelinedGPT.losses`)."""
    model.eval()
    losses = model.losses([sampler.micro_batches(i)[0] for i in range(iters)], dtype=dtype)
    model.train()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for loss in losses:
        total += loss.to(device)
    comm.all_reduce(total, dp_group)
    return float(total) / (iters * comm.group_size(dp_group))
