"""Analytic model of a TP x FSDP GPT training step (:func:`tensorpar.fully_shard`): FSDP2's
collectives in issue order among the TP ones, and the state each rank holds.

FSDP shards each unit (consecutive transformer blocks, as many as make ``min_unit_mib``; then the
root: embedding, position table, final norm, LM head and the blocks after the last unit) over the
DP group. Per step and rank: forward all-gathers each unit's parameters (the root first, then
each unit as its first block's forward starts); backward gathers each unit again when
``reshard_after_forward`` freed it (prefetched one unit ahead: the last unit's at the start of
backward, the one before unit ``u``'s just before the backward collectives of ``u``'s last block)
and reduce-scatters each unit's gradients as its backward ends, the root's last. A unit's collective
moves one flat buffer: every parameter's TP shard padded along dim 0 to a multiple of DP (FSDP2's
layout). Parameters travel in the compute dtype (``MixedPrecisionPolicy(param_dtype=...)``),
gradients in fp32 (``reduce_dtype``), averaged. After backward, the training loop's SP-grad
all-reduce covers only this rank's DP shards, and the grad norm adds a DP all-reduce.

Figures are DP rank 0's, which holds the largest shard. Pure arithmetic: the GPT config is any
object with :class:`~tensorpar.models.GPTConfig`'s fields.

Example (TP 2 x DP 2)::

    ops = step_collectives(CommConfig(layer="gpt-step", hidden=1024, layers=4, tp=2), config, FSDPConfig(dp=2))
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from .communication import CommConfig, CommOp, LinkModel, collectives
from ..data_parallel.fsdp import MIN_UNIT_MIB, check_min_unit_mib, least_unit_bytes
from ..data_parallel.fsdp import consecutive_groups

PARAM_GATHER = "FSDP parameter all-gather"
REGATHER = "FSDP re-gather for backward"
GRAD_REDUCE = "FSDP grad reduce-scatter"


@dataclasses.dataclass(frozen=True)
class FSDPConfig:
    """FSDP over ``dp`` DP ranks; ``reshard_after_forward=False`` is the ZeRO-2-like variant;
    ``min_unit_mib`` as :func:`tensorpar.fully_shard` takes it."""

    dp: int
    reshard_after_forward: bool = True
    min_unit_mib: float = MIN_UNIT_MIB

    def __post_init__(self) -> None:
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 2:
            raise ValueError(f"FSDP needs a DP size of at least 2 (over one rank it shards nothing), got {self.dp!r}")
        check_min_unit_mib(self.min_unit_mib, "FSDP")


@dataclasses.dataclass(frozen=True)
class DataParallelOp(CommOp):
    """A collective over the DP group of ``dp`` ranks (``tp`` stays the step's TP size)."""

    dp: int = 1

    @property
    def group_size(self) -> int:
        return self.dp


@dataclasses.dataclass(frozen=True)
class Unit:
    """One FSDP unit: each parameter's TP-shard shape, whether SP marks it (replicated over TP),
    and the transformer blocks it holds."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    sequence_parallel: tuple[bool, ...]
    blocks: tuple[int, ...] = ()

    def padded_numel(self, dp: int) -> int:
        """Elements of the unit's flat all-gather output / reduce-scatter input."""
        return sum(-(-s[0] // dp) * dp * math.prod(s[1:]) for s in self.shapes)

    def shard_numel(self, dp: int, *, only_sequence_parallel: bool = False) -> int:
        """Elements DP rank 0 holds (the first ``ceil(rows / dp)`` rows of each parameter)."""
        return sum(min(-(-s[0] // dp), s[0]) * math.prod(s[1:])
                   for s, sp in zip(self.shapes, self.sequence_parallel) if sp or not only_sequence_parallel)


def units(config, *, tp: int, min_unit_mib: float = MIN_UNIT_MIB) -> list[Unit]:
    """The FSDP units of a GPT ``config`` at ``tp``, root first, as :func:`tensorpar.fully_shard`
    makes them with ``min_unit_mib`` (0: one unit per block).

    FSDP cannot shard an uneven TP layout, so TP must divide the heads, K/V heads and FFN width.
    """
    h, f, heads, kv = config.hidden_size, config.ffn_hidden_size, config.num_heads, config.num_query_groups
    for name, value in (("heads", heads), ("kv_heads", kv), ("ffn_hidden", f)):
        if value % tp:
            raise ValueError(f"FSDP needs the TP size ({tp}) to divide {name} ({value}): an uneven TP layout "
                             "cannot be sharded")
    qkv, fc = (heads + 2 * kv) * (h // heads) // tp, (2 * f if config.activation == "swiglu" else f) // tp
    norm = [((h,), True)] * (2 if config.norm == "layernorm" and config.bias else 1)  # weight (and bias)

    def column(rows, has_bias):
        return [((rows, h), False)] + ([((rows,), False)] if has_bias else [])

    def row(cols):  # its bias is replicated over TP, so SP marks it
        return [((h, cols), False)] + ([((h,), True)] if config.bias else [])

    block = [*norm, *column(qkv, config.qkv_bias), *row(h // tp), *norm, *column(fc, config.bias), *row(f // tp)]
    multiple = math.lcm(config.make_vocab_size_divisible_by, tp)
    vocab = -(-config.vocab_size // multiple) * multiple // tp
    root = [((vocab, h), False), *([((config.max_seq_len, h), True)] if config.position_embedding == "learned" else []),
            *norm, *([] if config.tie_word_embeddings else [((vocab, h), False)])]

    def unit(name, params, blocks):
        params = params + block * len(blocks)
        return Unit(name, tuple(s for s, _ in params), tuple(sp for _, sp in params), tuple(blocks))

    block_bytes = 4 * sum(math.prod(s) for s, _ in block)  # FSDP keeps the parameters fp32
    groups, rest = consecutive_groups([block_bytes] * config.num_layers,
                                      at_least=least_unit_bytes(config, min_unit_mib))
    return [unit("root", root, rest),
            *(unit(f"blocks.{g[0]}" + (f"-{g[-1]}" if len(g) > 1 else ""), [], g) for g in groups)]


def step_collectives(cfg: CommConfig, config, fsdp: FSDPConfig, *, link: LinkModel | None = None) -> list[CommOp]:
    """Every collective of one TP x FSDP GPT training step on a rank, in issue order.

    ``cfg`` (``layer="gpt-step"``) gives the TP collectives (:func:`tensorpar.planning.communication.collectives`)
    and the compute dtype FSDP gathers in; ``config`` is the GPT it describes (the units' shapes);
    ``link`` decides ``overlap_chunks="auto"`` as in :func:`~tensorpar.planning.communication.collectives`.
    """
    if cfg.layer != "gpt-step":
        raise ValueError(f"FSDP is modelled for --layer gpt-step, not {cfg.layer}")
    dp, parts = fsdp.dp, units(config, tp=cfg.tp, min_unit_mib=fsdp.min_unit_mib)
    root, groups = parts[0], parts[1:]
    unit_of = {block: u for u, unit in enumerate(groups) for block in unit.blocks}

    def unit_op(unit, phase, op, what, dtype):
        return DataParallelOp(unit.name, phase, op, (unit.padded_numel(dp),), dtype, cfg.tp, what,
                              "avg" if op == "reduce_scatter" else None, dp=dp)

    def gather(unit, what=PARAM_GATHER):
        return unit_op(unit, "forward" if what == PARAM_GATHER else "backward", "all_gather", what, cfg.torch_dtype)

    def reduce(unit):
        return unit_op(unit, "backward", "reduce_scatter", GRAD_REDUCE, torch.float32)

    ops = collectives(cfg, link=link)
    per_block = [([], []) for _ in range(config.num_layers)]
    head, tail = ([], []), ([], [])  # (forward, backward) of the embedding; of the LM head and loss
    for op in ops:
        if op.phase == "grads":
            continue
        block = re.match(r"blocks\.(\d+)\.", op.layer)
        where = per_block[int(block.group(1))] if block else head if op.layer.startswith("embedding") else tail
        where[op.phase != "forward"].append(op)
    forward = [gather(root), *head[0]]
    for i, (fwd, _) in enumerate(per_block):
        u = unit_of.get(i)
        forward += [*([gather(groups[u])] if u is not None and groups[u].blocks[0] == i else []), *fwd]
    forward += tail[0]
    regather = fsdp.reshard_after_forward
    backward = [*([gather(groups[-1], REGATHER)] if regather and groups else []), *tail[1]]
    for i in reversed(range(config.num_layers)):
        u = unit_of.get(i)
        recompute = [op for op in per_block[i][1] if op.phase == "recompute"]
        prefetch = regather and u is not None and u > 0 and groups[u].blocks[-1] == i  # unit u's first block back
        backward += [*recompute, *([gather(groups[u - 1], REGATHER)] if prefetch else []),
                     *[op for op in per_block[i][1] if op.phase != "recompute"],
                     *([reduce(groups[u])] if u is not None and groups[u].blocks[0] == i else [])]
    backward += [*head[1], reduce(root)]
    return forward + backward + _grads(cfg, parts, dp)


def _grads(cfg: CommConfig, parts: list[Unit], dp: int) -> list[CommOp]:
    """After backward, as ``tensorpar train`` does: under SP one fp32 all-reduce over TP of this
    rank's shards of the SP-marked parameters; the grad norm's squares summed over DP, then TP."""
    fp32, ops = torch.float32, []
    if cfg.sp and cfg.tp > 1:
        numel = sum(u.shard_numel(dp, only_sequence_parallel=True) for u in parts)
        ops.append(CommOp("sp_grads", "grads", "all_reduce", (numel,), fp32, cfg.tp, "sequence-parallel param grads",
                          "sum"))
    ops.append(DataParallelOp("grad_norm", "grads", "all_reduce", (), fp32, cfg.tp, "grad norm over DP shards", "sum",
                              dp=dp))
    if cfg.tp > 1:
        ops.append(CommOp("grad_norm", "grads", "all_reduce", (), fp32, cfg.tp, "grad norm", "sum"))
    return ops


def state_bytes_per_rank(config, *, tp: int, dp: int, fsdp: bool = True) -> dict[str, int]:
    """Bytes DP rank 0 holds between steps with AdamW: fp32 parameters (under FSDP the masters),
    fp32 gradients and two fp32 moments; 1/DP each under FSDP (ZeRO-3 and ZeRO-2-like alike)."""
    parts = units(config, tp=tp)
    numel = sum(u.shard_numel(dp) for u in parts) if fsdp else sum(u.shard_numel(1) for u in parts)
    return {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer": 8 * numel}
