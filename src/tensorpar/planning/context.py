"""Analytic model of a context-parallel GPT step (:mod:`tensorpar.context_parallel`): the CP collectives
of every layer in issue order among the TP ones, the weight-gradient reduction over DP x CP,
and how much of the ring's communication the attention of the block in hand hides.

Each CP rank runs the GPT on its two chunks of every sequence (``local`` tokens: the sequence
padded to a multiple of ``2 CP`` (``2 CP TP`` under SP), then cut in ``2 CP`` chunks), so every
TP collective moves ``local`` rows instead of ``seq_len``. Attention adds, per layer:

* ``a2a`` (Ulysses): forward an all-to-all of this rank's Q|K|V to the head split (each
  destination gets its query heads and the K/V heads they read: uneven sizes where CP does not
  divide the heads) and one of the output back; backward their reverses. A record is the
  tensor this rank sends, so its size is the rank's own.
* ``p2p`` (ring): forward ``CP - 1`` ``send_recv`` of the stacked K/V ``[2, b, G, local, d]``;
  backward ``CP - 1`` of the K/V again and ``CP`` of their fp32 gradients ``[2, b, G, 1, local, d]``,
  interleaved (each step's K/V, then the gradients accumulated so far).

The loss adds two CP all-reduces (the labelled-token count, int64, and the loss sum, fp32).
After backward, ``tensorpar train``'s ``DataParallelGradReducer`` averages every weight gradient
over DP x CP in fp32 buckets (of about 25 MiB, filled in reverse parameter order); the SP
gradients are then its fp32 ``main_grad``. tensorpar train launches each bucket as it fills
during backward; the model lists them at the step's end, as ``tensorpar comm --measure`` runs
them (``sync=False``, then ``finish()``), so the two agree in order.

Example (GPT at TP 2, CP 2, ring)::

    ops = step_collectives(CommConfig(layer="gpt-step", hidden=1024, layers=4, tp=2), config,
                           ContextConfig(cp=2, comm_type="p2p"))
    ring_overlap(cfg, ContextConfig(cp=2), link)      # per phase: communication, compute, exposed
"""

from __future__ import annotations

import dataclasses

import torch

from .communication import CommConfig, CommOp, GroupOp, LinkModel, _Builder, _Comm, step_flops_per_rank
from ..context_parallel import COMM_TYPES, SequenceChunks, head_split
from .fsdp import units

BUCKET_BYTES = 25 * 2**20  # DataParallelGradReducer's default


@dataclasses.dataclass(frozen=True)
class ContextConfig:
    """Context parallelism over ``cp`` ranks by ``comm_type``, weight gradients reduced over ``dp x cp``."""

    cp: int
    comm_type: str = "p2p"
    dp: int = 1

    def __post_init__(self) -> None:
        for name, least in (("cp", 2), ("dp", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"the {name.upper()} size must be an int of at least {least}, got {value!r}")
        if self.comm_type not in COMM_TYPES:
            raise ValueError(f"--cp-comm must be one of {', '.join(COMM_TYPES)}, got {self.comm_type!r}")


def chunks(cfg: CommConfig, cp: ContextConfig, cp_rank: int = 0) -> SequenceChunks:
    """CP rank ``cp_rank``'s chunks of ``cfg``'s sequence (chunks a multiple of TP under SP)."""
    return SequenceChunks(cfg.seq_len, cp.cp, cp_rank, cfg.tp if cfg.sp else 1)


def attention_comm(*, heads: int, kv_heads: int, head_dim: int, batch: int, local_len: int, cp: int,
                   cp_rank: int, comm_type: str, dtype: torch.dtype, tp: int = 1,
                   layer: str = "attention") -> _Comm:
    """The CP collectives of one :func:`tensorpar.context_parallel.context_attention` call on CP rank
    ``cp_rank``: ``heads`` and ``kv_heads`` are this TP rank's, ``local_len`` its tokens."""

    def op(phase, kind, shape, what, op_dtype=dtype):
        return GroupOp(layer, phase, kind, tuple(shape), op_dtype, tp, what, None, group="cp", size=cp)

    rest = (batch, local_len, head_dim)
    if comm_type == "p2p":
        kv = (2, batch, kv_heads, local_len, head_dim)
        grad = (2, batch, kv_heads, 1, local_len, head_dim)
        backward = []
        for step in range(cp):
            if step < cp - 1:
                backward.append(op("backward", "send_recv", kv, "K/V to the next rank"))
            backward.append(op("backward", "send_recv", grad, "dK/dV so far (fp32) to the next rank", torch.float32))
        return _Comm(forward=(op("forward", "send_recv", kv, "K/V to the next rank"),) * (cp - 1),
                     backward=tuple(backward))
    split = head_split(heads, kv_heads, cp)
    sizes = [h1 - h0 + 2 * (g1 - g0) for h0, h1, g0, g1 in split]
    local = split[cp_rank][1] - split[cp_rank][0]
    return _Comm(forward=(op("forward", "all_to_all", (sum(sizes), *rest), "Q|K|V to the head split"),
                          op("forward", "all_to_all", (cp * local, *rest), "output back to the sequence split")),
                 backward=(op("backward", "all_to_all", (heads, *rest), "output grad to the head split"),
                           op("backward", "all_to_all", (cp * sizes[cp_rank], *rest), "Q|K|V grads back")))


class _ContextBuilder(_Builder):
    """The TP builder on a CP rank's tokens, with attention's and the loss's CP collectives."""

    def __init__(self, cfg: CommConfig, cp: ContextConfig, link: LinkModel | None, cp_rank: int) -> None:
        super().__init__(cfg, link)
        self.cp, self.cp_rank = cp, cp_rank
        self.s = chunks(cfg, cp, cp_rank).local_len

    def attention(self, prefix: str) -> _Comm:
        tp = super().attention(prefix)
        qkv = f"{prefix}qkv"
        first = sum(op.layer == qkv for op in tp.forward)       # forward: the QKV layer's, then the projection's
        last = sum(op.layer != qkv for op in tp.backward)       # backward: the projection's, then the QKV layer's
        cfg = self.cfg
        cp = attention_comm(heads=cfg.heads // cfg.tp, kv_heads=cfg.kv_heads // cfg.tp,
                            head_dim=cfg.hidden // cfg.heads, batch=self.b, local_len=self.s, cp=self.cp.cp,
                            cp_rank=self.cp_rank, comm_type=self.cp.comm_type, dtype=cfg.torch_dtype, tp=cfg.tp,
                            layer=f"{prefix}core")
        return _Comm(forward=tp.forward[:first] + cp.forward + tp.forward[first:],
                     backward=tp.backward[:last] + cp.backward + tp.backward[last:])

    def loss(self, name: str, tokens: tuple[int, ...]) -> _Comm:
        def op(dtype, what):
            return GroupOp(name, "forward", "all_reduce", (), dtype, self.cfg.tp, what, "sum", group="cp",
                           size=self.cp.cp)

        return _Comm(forward=super().loss(name, tokens).forward + (
            op(torch.int64, "labelled tokens over CP"), op(torch.float32, "loss sum over CP")))


def check(cfg: CommConfig, cp: ContextConfig) -> None:
    """Raise ``ValueError`` naming what CP (or this model of it) cannot run for ``cfg``."""
    if cfg.layer != "gpt-step":
        raise ValueError(f"--cp models a GPT step's attention: use --layer gpt-step, not {cfg.layer}")
    for name, value in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("ffn_hidden", cfg.ffn_hidden)):
        if value % cfg.tp:
            raise ValueError(f"context parallelism needs the TP size ({cfg.tp}) to divide {name} ({value})")
    if cp.comm_type == "a2a":
        head_split(cfg.heads // cfg.tp, cfg.kv_heads // cfg.tp, cp.cp)


def parameter_numels(config, *, tp: int) -> list[int]:
    """Elements of each parameter of a GPT ``config`` on a TP rank, in ``parameters()`` order."""
    root, *blocks = units(config, tp=tp, min_unit_mib=0)  # the blocks one by one, in order
    before = 1 + (config.position_embedding == "learned")  # the position table, then the word embedding
    shapes = [*root.shapes[:before][::-1], *(s for block in blocks for s in block.shapes), *root.shapes[before:]]
    return [torch.Size(s).numel() for s in shapes]


def buckets(numels: list[int], *, bucket_bytes: int = BUCKET_BYTES) -> list[int]:
    """The fp32 buckets of a ``DataParallelGradReducer`` over parameters of ``numels``, in launch order."""
    out, pending = [], 0
    for numel in reversed(numels):
        pending += numel
        if pending * 4 >= bucket_bytes:
            out.append(pending)
            pending = 0
    return out + ([pending] if pending else [])


def step_collectives(cfg: CommConfig, config, cp: ContextConfig, *, cp_rank: int = 0,
                     link: LinkModel | None = None) -> list[CommOp]:
    """Every collective of one CP (x TP) GPT training step on CP rank ``cp_rank``, in issue
    order; ``config`` is the GPT (the reducer's buckets), ``link`` decides ``overlap_chunks="auto"``."""
    check(cfg, cp)
    build = _ContextBuilder(cfg, cp, link, cp_rank)
    comm, tp_grads = build.gpt_step()
    ops = [op for op in (*comm.forward, *comm.backward) if isinstance(op, GroupOp) or cfg.tp > 1]
    reduced = buckets(parameter_numels(config, tp=cfg.tp))
    grads = [GroupOp("grad_reducer", "grads", "all_reduce", (n,), torch.float32, cfg.tp,
                     f"weight grads averaged over DP x CP (bucket {i + 1}/{len(reduced)})", "sum",
                     group="dp x cp", size=cp.dp * cp.cp) for i, n in enumerate(reduced)]
    # After the reducer the SP grads are its fp32 main_grad.
    grads += [dataclasses.replace(op, dtype=torch.float32) for op in tp_grads] if cfg.tp > 1 else []
    return ops + grads


def transfer_seconds(op: CommOp, link: LinkModel) -> float:
    """Seconds of ``op`` on ``link``: one latency and the bytes a rank sends."""
    return link.latency_s + op.bytes_sent_per_rank / link.bytes_per_s


def ring_overlap(cfg: CommConfig, cp: ContextConfig, link: LinkModel) -> list[dict]:
    """Per phase of one layer's ring attention (``forward``, ``recompute`` with ``cfg.recompute``,
    ``backward``): the ring's communication, the attention compute and the exposed communication
    (seconds on ``link``). In ring step ``t`` a rank attends to the K/V in hand (3 chunk pairs in
    step 0, two of them causal, 2 in every other, each computed whole) while the next K/V travel,
    and in backward also the dK/dV of step ``t - 1``; the last dK/dV pass waits alone."""
    mine = chunks(cfg, cp)
    comm = attention_comm(heads=cfg.heads // cfg.tp, kv_heads=cfg.kv_heads // cfg.tp, head_dim=cfg.hidden // cfg.heads,
                          batch=cfg.batch, local_len=mine.local_len, cp=cp.cp, cp_rank=0, comm_type="p2p",
                          dtype=cfg.torch_dtype, tp=cfg.tp)
    kv_s = transfer_seconds(comm.forward[0], link) if comm.forward else 0.0
    grad_s = transfer_seconds(comm.backward[-1], link)
    # A chunk pair: Q K^T and P V forward (2 matmuls), 5 backward (the scores again, dV, dP, dK, dQ).
    pair = 2 * cfg.batch * (cfg.heads // cfg.tp) * mine.chunk_len ** 2 * (cfg.hidden // cfg.heads)
    rows = []
    for phase, matmuls in (("forward", 2), *((("recompute", 2),) if cfg.recompute else ()), ("backward", 5)):
        backward = phase == "backward"
        total = compute = communication = 0.0
        for step in range(cp.cp):
            work = (3 if step == 0 else 2) * matmuls * pair / link.flops_per_s
            travel = (kv_s if step < cp.cp - 1 else 0.0) + (grad_s if backward and step > 0 else 0.0)
            total += work + travel - link.overlap * min(work, travel)
            compute, communication = compute + work, communication + travel
        if backward:  # the last step's dK/dV go home after its attention
            total, communication = total + grad_s, communication + grad_s
        rows.append(dict(phase=phase, steps=cp.cp, communication_s=communication, compute_s=compute,
                         exposed_s=total - compute))
    return rows


def overlap_plan(cfg: CommConfig, cp: ContextConfig, link: LinkModel) -> list[dict]:
    """:func:`tensorpar.planning.communication.overlap_plan` of a CP rank's tokens."""
    if cfg.tp == 1:
        return []
    build = _ContextBuilder(cfg, cp, link, 0)
    build.gpt_step()
    return build.plan


def flops_per_rank(cfg: CommConfig, cp: ContextConfig) -> float:
    """A CP rank's share of the step's matmul FLOPs: the padded sequence's over CP (the chunks
    balance the causal work; padding computes as tokens do)."""
    return step_flops_per_rank(dataclasses.replace(cfg, seq_len=chunks(cfg, cp).padded_len)) / cp.cp
