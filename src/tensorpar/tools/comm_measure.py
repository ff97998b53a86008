"""``tensorpar comm --measure``: run a layer or GPT step on local gloo ranks under a
:class:`tensorpar.CommLedger` and return the collectives it issued, as comparable keys.

With an :class:`~tensorpar.fsdp_model.FSDPConfig` the GPT step runs under
:func:`tensorpar.fully_shard` on TP x DP ranks, its parameters fp32 and gathered in the compute
dtype (FSDP's mixed precision), as :mod:`tensorpar.fsdp_model` models it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..comm import CommLedger
from ..comm_model import CommConfig
from ..cross_entropy import vocab_parallel_cross_entropy
from ..embedding import VocabParallelEmbedding
from ..fsdp import fully_shard
from ..fsdp_model import FSDPConfig
from ..grads import allreduce_sequence_parallel_grads, get_grad_norm
from ..linear import ColumnParallelLinear, RowParallelLinear
from ..models import GPT, GPTConfig
from ..parallel_state import destroy_model_parallel, initialize_model_parallel
from ..random import checkpoint, model_parallel_manual_seed
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
    return (op.phase, op.op, tuple(op.shape), str(op.dtype).replace("torch.", ""), op.bytes, op.reduce_op)


class _OutputOnly(nn.Module):
    """A TP linear (which returns ``(output, bias)``) as a module returning its output."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def _workload(cfg: CommConfig):
    """``(module, args)``: the layer of ``cfg`` on this rank and its inputs."""
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


def measure_on_this_rank(cfg: CommConfig, *, fsdp: FSDPConfig | None = None, seed: int = 0) -> list[tuple]:
    """Run ``cfg``'s layer forward and backward here and return its collectives' keys.

    Needs ``tensorpar.initialize_model_parallel(cfg.tp)`` with a TP group of ``cfg.tp`` ranks
    (and with ``fsdp``, a DP group of ``fsdp.dp``).
    """
    model_parallel_manual_seed(seed)
    module, args = _workload(dataclasses.replace(cfg, dtype="fp32") if fsdp else cfg)
    if fsdp:
        policy = MixedPrecisionPolicy(param_dtype=cfg.torch_dtype, reduce_dtype=torch.float32)
        fully_shard(module, reshard_after_forward=fsdp.reshard_after_forward, mp_policy=policy)
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
            out.backward(torch.ones_like(out))
        if step:
            with ledger.phase("grads"):  # as tensorpar train does after backward
                allreduce_sequence_parallel_grads(module)
                get_grad_norm(module.parameters())
    return [record_key(r) for r in ledger.records]


def _measure_rank(cfg: CommConfig, fsdp: FSDPConfig | None) -> list[tuple]:
    torch.set_num_threads(1)
    initialize_model_parallel(cfg.tp, backend="gloo", timeout=_MEASURE_TIMEOUT_S)
    try:
        return measure_on_this_rank(cfg, fsdp=fsdp)
    finally:
        destroy_model_parallel()


def measure(cfg: CommConfig, *, fsdp: FSDPConfig | None = None) -> list[tuple]:
    """Start ``cfg.tp`` (x ``fsdp.dp``) local gloo ranks, run the layer on them, return rank 0's record keys."""
    return launch_local(_measure_rank, cfg, fsdp, nproc=cfg.tp * (fsdp.dp if fsdp else 1))[0]


def scaled(cfg: CommConfig, scale: int) -> CommConfig:
    """``cfg`` with sequence, hidden, FFN and vocab sizes divided by ``scale``."""
    sizes = {name: getattr(cfg, name) for name in ("seq_len", "hidden", "ffn_hidden", "vocab")}
    for name, value in sizes.items():
        if value % scale != 0:
            raise ValueError(f"--scale {scale} does not divide {name} ({value})")
    return dataclasses.replace(cfg, **{name: value // scale for name, value in sizes.items()})

