"""``tensorpar comm --measure``: run a layer or GPT step on local gloo ranks under a
:class:`tensorpar.CommLedger` and return the collectives it issued, as comparable keys.

With an :class:`~tensorpar.planning.fsdp.FSDPConfig` the GPT step runs under
:func:`tensorpar.fully_shard` on TP x DP ranks, its parameters fp32 and gathered in the compute
dtype (FSDP's mixed precision), as :mod:`tensorpar.planning.fsdp` models it. With a
:class:`~tensorpar.planning.context.ContextConfig` it runs over a CP group on TP x CP x DP ranks;
with a :class:`~tensorpar.pipeline_parallel.PipelineCost` as ``tensorpar train --pp`` runs it on TP x PP
ranks (:func:`measure_pipeline_on_this_rank`); :func:`measure_ranks` returns every rank's keys.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..distributed.comm import CommLedger
from ..planning.communication import CommConfig
from ..planning.context import ContextConfig
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.embedding import VocabParallelEmbedding
from ..data_parallel.fsdp import fully_shard
from ..planning.fsdp import FSDPConfig
from ..data_parallel.grads import DataParallelGradReducer, allreduce_sequence_parallel_grads, get_grad_norm
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..models import GPT, GPTConfig
from ..parallel_state import (
    default_device,
    destroy_model_parallel,
    get_context_parallel_group,
    get_data_parallel_group,
    get_pipeline_model_parallel_group,
    initialize_model_parallel,
)
from ..planning.pipeline import PipelineCost
from ..tensor_parallel.random import checkpoint, model_parallel_manual_seed
from ..training.pipeline_step import PipelinedGPT
from .launch import launch_local

_MEASURE_TIMEOUT_S = 120


class _RecomputeLabels:
    """Labels the collectives of a checkpointed module ``recompute`` when it re-runs in backward.

    A checkpointed module's forward runs once in the forward pass and once more, to recompute
    its activations, during the backward pass; the second run is what gets the label.
    """

    def __init__(self, ledger: CommLedger) -> None:
        self.ledger, self.in_backward, self._open = ledger, False, []

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit)

    def _enter(self, module, args) -> None:
        if self.in_backward:
            phase = self.ledger.phase("recompute")
            phase.__enter__()
            self._open.append(phase)

    def _exit(self, module, args, output) -> None:
        if self.in_backward:
            self._open.pop().__exit__(None, None, None)


def record_key(op) -> tuple:
    """What prediction and measurement must agree on: a ``CommOp`` or ``CommRecord``."""
    return (op.phase, op.op, tuple(op.shape), str(op.dtype).replace("torch.", ""), op.bytes, op.reduce_op,
            op.group_size)


class _OutputOnly(nn.Module):
    """A TP linear (which returns ``(output, bias)``) as a module returning its output."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def _workload(cfg: CommConfig, context: ContextConfig | None = None):
    """``(module, args)``: the layer of ``cfg`` on this rank and its inputs (with ``context``,
    the GPT over the CP group: every CP rank takes the same whole sequences)."""
    n, dtype = cfg.tp, cfg.torch_dtype
    s, b, h = cfg.seq_len, cfg.batch, cfg.hidden
    local_s = s // n if cfg.sp else s
    if cfg.layer == "column":
        layer = ColumnParallelLinear(h, h, gather_output=cfg.gather_output, sequence_parallel=cfg.sp,
                                     params_dtype=dtype, overlap=cfg.overlap_chunks)
        return _OutputOnly(layer), (torch.randn(local_s, b, h, dtype=dtype, requires_grad=True),)
    if cfg.layer == "row":
        layer = RowParallelLinear(h, h, input_is_parallel=cfg.input_is_parallel, sequence_parallel=cfg.sp,
                                  params_dtype=dtype, overlap=cfg.overlap_chunks)
        width = layer.weight.shape[1] if cfg.input_is_parallel else h  # this rank's share of the columns
        return _OutputOnly(layer), (torch.randn(s, b, width, dtype=dtype, requires_grad=True),)
    if cfg.layer == "embedding":
        layer = VocabParallelEmbedding(cfg.vocab, h, reduce_scatter_embeddings=cfg.sp, params_dtype=dtype)
        return layer, (torch.randint(0, cfg.vocab, (b, s)),)
    if cfg.layer == "loss":
        logits = torch.randn(s, b, cfg.vocab // n, dtype=dtype, requires_grad=True)
        return _Loss(), (logits, torch.randint(0, cfg.vocab, (s, b)))
    if context:
        config = dataclasses.replace(gpt_config(cfg), context_parallel_comm=context.comm_type)
        gpt = GPT(config, cp_group=get_context_parallel_group())
    else:
        gpt = GPT(gpt_config(cfg))
    if cfg.layer == "gpt-step":
        tokens = torch.randint(0, cfg.vocab, (b, s))
        return gpt, (tokens, torch.randint(0, cfg.vocab, (b, s)))
    block = gpt.blocks[0]
    x = torch.randn(local_s, b, h, dtype=dtype, requires_grad=True)
    if cfg.layer == "attention":
        return block.attention, (x, None, None)  # no rotary tables: learned positions
    return {"mlp": block.mlp, "gpt-layer": block}[cfg.layer], (x,)


def gpt_config(cfg: CommConfig) -> GPTConfig:
    """The GPT whose blocks the mlp, attention, gpt-layer and gpt-step workloads are."""
    return GPTConfig(vocab_size=cfg.vocab, max_seq_len=cfg.seq_len, num_layers=cfg.layers, num_heads=cfg.heads,
                     num_query_groups=cfg.kv_heads,
                     hidden_size=cfg.hidden, ffn_hidden_size=cfg.ffn_hidden, sequence_parallel=cfg.sp,
                     recompute=cfg.recompute, make_vocab_size_divisible_by=1, params_dtype=cfg.torch_dtype,
                     overlap=cfg.overlap_chunks)


def check_measurable(cfg: CommConfig) -> None:
    """Raise ``ValueError`` (naming the sizes) if ``cfg``'s workload cannot be built on ``cfg.tp`` ranks."""
    if cfg.layer not in ("mlp", "attention", "gpt-layer", "gpt-step"):
        return
    what = f"--measure runs --layer {cfg.layer} as part of a GPT block"
    if cfg.hidden % cfg.heads:
        raise ValueError(f"{what}: --hidden {cfg.hidden} is not divisible by --heads {cfg.heads}")
    gpt_config(cfg)


class _Loss(nn.Module):
    """The vocab-parallel loss as a module, like every other workload."""

    def forward(self, logits, target):
        return vocab_parallel_cross_entropy(logits, target)


def measure_on_this_rank(cfg: CommConfig, *, fsdp: FSDPConfig | None = None, context: ContextConfig | None = None,
                         seed: int = 0) -> list[tuple]:
    """Run ``cfg``'s layer forward and backward here and return its collectives' keys.

    Needs ``tensorpar.initialize_model_parallel(cfg.tp)`` with a TP group of ``cfg.tp`` ranks
    (and with ``fsdp``, a DP group of ``fsdp.dp``; with ``context``, ``context_parallel_size=``
    its CP size: the GPT step then runs over the CP group, its weight gradients averaged over
    DP x CP by a ``DataParallelGradReducer`` at the step's end, as ``context_model`` lists them).
    """
    model_parallel_manual_seed(seed)
    module, args = _workload(dataclasses.replace(cfg, dtype="fp32") if fsdp else cfg, context)
    if fsdp:
        policy = MixedPrecisionPolicy(param_dtype=cfg.torch_dtype, reduce_dtype=torch.float32)
        fully_shard(module, reshard_after_forward=fsdp.reshard_after_forward, min_unit_mib=fsdp.min_unit_mib,
                    mp_policy=policy)
    reducer = DataParallelGradReducer(module.parameters(), dp_group=get_data_parallel_group(
        with_context_parallel=True)) if context else None
    step = cfg.layer == "gpt-step"
    with CommLedger() as ledger:
        labels = _RecomputeLabels(ledger)
        for checkpointed in (module.blocks if step else [module]):
            labels.attach(checkpointed)
        with ledger.phase("forward"):
            # The GPT checkpoints its own blocks; a lone layer is checkpointed here.
            out = checkpoint(module, False, *args) if cfg.recompute and not step else module(*args)
        with ledger.phase("backward"):
            labels.in_backward = True
            if reducer:
                reducer.sync = False  # its buckets at the step's end, in order: finish()
            out.backward(torch.ones_like(out))
        if step:
            with ledger.phase("grads"):  # as tensorpar train does after backward
                if reducer:
                    reducer.finish()
                allreduce_sequence_parallel_grads(module)
                get_grad_norm(module.parameters())
    return [record_key(r) for r in ledger.records]


def _label(ledger: CommLedger, labels: _RecomputeLabels, owner, name: str, phase: str) -> None:
    """Run ``owner.name`` (a pipeline stage's or schedule's) in the ledger's ``phase``."""
    method = getattr(owner, name)

    def labelled(*args, **kwargs):
        before, labels.in_backward = labels.in_backward, phase == "backward"
        try:
            with ledger.phase(phase):
                return method(*args, **kwargs)
        finally:
            labels.in_backward = before

    setattr(owner, name, labelled)


def measure_pipeline_on_this_rank(cfg: CommConfig, cost: PipelineCost, *, seed: int = 0) -> list[tuple]:
    """Run a step of ``cfg``'s GPT cut as ``cost`` says (:class:`~tensorpar.training.pipeline_step.PipelinedGPT`,
    as ``tensorpar train --pp`` does) after a first one (the shape exchange) and return its
    collectives' keys: the micro-batches' forwards (the loss included) and activation sends
    ``forward``, their backwards and gradient sends ``backward``, what follows the schedule
    (SP and tied-embedding sums, the loss broadcast, the grad norm) ``grads``.

    Needs ``tensorpar.initialize_model_parallel(cfg.tp, cost.pp_size)``.
    """
    model_parallel_manual_seed(seed)
    virtual = cost.stages_per_rank if cost.layout.placement == "loop" else None
    model = PipelinedGPT(gpt_config(cfg), schedule=cost.schedule, microbatches=cost.microbatches,
                         virtual_stages=virtual, device=default_device())
    reducer = DataParallelGradReducer(model.parameters(), dp_group=get_data_parallel_group())
    batches = [tuple(torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len)) for _ in range(2))
               for _ in range(cost.microbatches)]

    def step():
        reducer.zero_grad()
        model.train_step(batches, reducer=reducer, dtype="fp32")
        reducer.finish()
        get_grad_norm(model.parameters(), pp_group=get_pipeline_model_parallel_group())

    step()  # the first step exchanges the shapes and runs a dummy micro-batch
    with CommLedger() as ledger:
        labels = _RecomputeLabels(ledger)
        for stage in model.schedule._torch_stages:
            for block in stage.submod.blocks:
                labels.attach(block)
            for name in ("forward_one_chunk", "get_fwd_send_ops", "get_fwd_recv_ops"):
                _label(ledger, labels, stage, name, "forward")
            for name in ("backward_one_chunk", "backward_weight_one_chunk", "get_bwd_send_ops", "get_bwd_recv_ops"):
                _label(ledger, labels, stage, name, "backward")
        _label(ledger, labels, model.schedule._schedule, "_loss_fn", "forward")
        with ledger.phase("grads"):
            step()
    return [record_key(r) for r in ledger.records]


def _measure_rank(cfg: CommConfig, fsdp: FSDPConfig | None, context: ContextConfig | None = None,
                  pipeline: PipelineCost | None = None) -> list[tuple]:
    torch.set_num_threads(1)
    initialize_model_parallel(cfg.tp, pipeline.pp_size if pipeline else 1,
                              context_parallel_size=context.cp if context else 1, backend="gloo",
                              timeout=_MEASURE_TIMEOUT_S)
    try:
        if pipeline:
            return measure_pipeline_on_this_rank(cfg, pipeline)
        return measure_on_this_rank(cfg, fsdp=fsdp, context=context)
    finally:
        destroy_model_parallel()


def measure(cfg: CommConfig, *, fsdp: FSDPConfig | None = None) -> list[tuple]:
    """Start ``cfg.tp`` (x ``fsdp.dp``) local gloo ranks, run the layer on them, return rank 0's record keys."""
    return measure_ranks(cfg, fsdp=fsdp)[0]


def measure_ranks(cfg: CommConfig, *, fsdp: FSDPConfig | None = None, context: ContextConfig | None = None,
                  pipeline: PipelineCost | None = None) -> dict[int, list[tuple]]:
    """Start TP (x ``fsdp``'s DP, x ``context``'s CP x DP, or x ``pipeline``'s PP) local gloo ranks,
    run the layer or GPT step on them, return every rank's record keys."""
    nproc = cfg.tp * (fsdp.dp if fsdp else 1) * (context.cp * context.dp if context else 1) * (
        pipeline.pp_size if pipeline else 1)
    return launch_local(_measure_rank, cfg, fsdp, context, pipeline, nproc=nproc)


def scaled(cfg: CommConfig, scale: int) -> CommConfig:
    """``cfg`` with sequence, hidden, FFN and vocab sizes divided by ``scale``."""
    sizes = {name: getattr(cfg, name) for name in ("seq_len", "hidden", "ffn_hidden", "vocab")}
    for name, value in sizes.items():
        if value % scale != 0:
            raise ValueError(f"--scale {scale} does not divide {name} ({value})")
    return dataclasses.replace(cfg, **{name: value // scale for name, value in sizes.items()})

