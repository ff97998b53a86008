"""The analytic cost of a pipeline step: the bytes of each activation send between stages, the
sends and receives of each rank per step, the schedule's bubble fraction, the micro-batches each
stage holds in flight (:func:`in_flight`) and so each PP rank's memory (:func:`pipeline_memory`).

Pure arithmetic on a :class:`tensorpar.planning.communication.CommConfig` (``batch`` is the micro-batch
size; ``dtype`` the dtype of the hidden states between blocks: the parameters' dtype, so fp32
under ``tensorpar train --dtype bf16``'s autocast of fp32 weights). It counts what
:class:`tensorpar.pipeline_parallel.TorchStage` records in a ``CommLedger`` in a step after the first.

Example (GPT at hidden 4096, seq 2048, bf16, PP=2, 1F1B, 4 micro-batches)::

    cost = pipeline_cost(CommConfig(layer="gpt-step", tp=1), pp_size=2, schedule="1f1b", microbatches=4)
    cost.send_shape, cost.bytes_per_send    # (2048, 1, 4096), 16777216
    [r.sends for r in cost.ranks]           # [4, 4]: rank 0 its activations, rank 1 their gradients
    cost.bubble                             # 0.2 = (2 - 1) / (4 + 2 - 1)
"""

from __future__ import annotations

import dataclasses
import re
import types

import torch

from .communication import CommConfig, CommOp, GroupOp, LinkModel, collectives
from .memory import StageShare, gpt_training_memory
from ..pipeline_parallel.plan import StageLayout, check_microbatches, schedule_spec, stage_layout, stages_per_rank

# Why the zero-bubble and DualPipeV schedules get no number: their bubble depends on how the
# backward's time splits into the input gradient (B) and the weight gradient (W), which this
# model does not know. With F = B = W the zero-bubble schedules have (nearly) none (Qi et al.,
# "Zero Bubble Pipeline Parallelism", ICLR 2024, and "Pipeline Parallelism with Controllable
# Memory", 2024, for ZB-V); DualPipe's is (PP/2 - 1)(F&B + B - 3W) (DeepSeek-V3 technical
# report, 2024, table 2), DualPipeV being its V-shaped half.
NOT_MODELLED = "not modelled: it depends on the backward's split into input and weight gradients"
# The schedules whose every backward torch splits into an input pass and a later weight pass.
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")


@dataclasses.dataclass(frozen=True)
class RankTraffic:
    """One PP rank's point-to-point traffic in one step: its stages, and how many activations
    (forward) and activation gradients (backward) it sends and receives."""

    rank: int
    stages: tuple[int, ...]
    activation_sends: int
    gradient_sends: int
    activation_recvs: int
    gradient_recvs: int

    @property
    def sends(self) -> int:
        return self.activation_sends + self.gradient_sends

    @property
    def recvs(self) -> int:
        return self.activation_recvs + self.gradient_recvs


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """What :func:`pipeline_cost` predicts; ``bubble`` is ``None`` where not modelled."""

    schedule: str
    pp_size: int
    stages_per_rank: int
    microbatches: int
    layout: StageLayout
    send_shape: tuple[int, int, int]
    dtype: torch.dtype
    bytes_per_send: int
    ranks: tuple[RankTraffic, ...]
    bubble: float | None
    bubble_formula: str

    def send_time_s(self, *, bandwidth_gbps: float, latency_us: float) -> float:
        """Seconds of one send on a link of ``bandwidth_gbps`` GB/s and ``latency_us``."""
        return latency_us * 1e-6 + self.bytes_per_send / (bandwidth_gbps * 1e9)


def bubble_fraction(schedule: str, *, pp_size: int, microbatches: int,
                    virtual_stages: int | None = None) -> tuple[float | None, str]:
    """The share of a step's time a rank idles, and its formula (or why it is not modelled).

    Every stage takes the same time. GPipe and 1F1B: ``(P-1)/(M+P-1)`` (Huang et al., GPipe,
    2019; Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters",
    SC21, sec. 2.2: ``(P-1)/M`` of the ideal time). Interleaved 1F1B and looped BFS with ``V``
    stages per rank: ``(P-1)/(V M+P-1)`` (the same paper, sec. 2.2.2; Lamy-Poirier,
    "Breadth-First Pipeline Parallelism", 2022); with ``M < P`` each loop back also waits
    ``P - M`` stage-times. Example::

        bubble_fraction("1f1b", pp_size=2, microbatches=4)   # (0.2, '(P-1)/(M+P-1) = 1/5')
    """
    check_microbatches(schedule, microbatches=microbatches, pp_size=pp_size, virtual_stages=virtual_stages)
    p, m, v = pp_size, microbatches, stages_per_rank(schedule, virtual_stages)
    placement = schedule_spec(schedule).placement
    if placement == "v" or schedule.lower() == "interleaved-zb":
        return None, NOT_MODELLED
    if placement == "single":
        return (p - 1) / (m + p - 1), f"(P-1)/(M+P-1) = {p - 1}/{m + p - 1}"
    # Stage r + P's first micro-batch reaches rank r P stage-times after stage r's (a stage-time
    # is 1/V of a rank's work on one micro-batch); with M < P the rank has only M stage-times of
    # work meanwhile, so each of the V - 1 loops back waits P - M more.
    idle = p - 1 + (v - 1) * max(0, p - m)
    formula = "(P-1)/(V M+P-1)" if m >= p else "(P-1 + (V-1)(P-M))/(V M + P-1 + (V-1)(P-M))"
    return idle / (v * m + idle), f"{formula} = {idle}/{v * m + idle}"


def _remote(layout: StageLayout, stage: int, neighbour: int) -> bool:
    """Whether ``neighbour`` is a stage on another rank (neighbours on one rank call each other)."""
    return 0 <= neighbour < layout.num_stages and layout.rank_of(neighbour) != layout.rank_of(stage)


def _rank_actions(schedule: str, *, pp_size: int, microbatches: int, stages: int, rank: int) -> list[tuple]:
    """``(stage, kind, micro-batch)`` of each compute action PP rank ``rank`` runs, in order;
    ``kind`` is ``F`` (forward), ``B`` (whole backward), ``I`` (input gradient) or ``W`` (weight
    gradient). The single-stage schedules' loops are written out as torch runs them; the
    multi-stage ones are torch's own ``pipeline_order`` (its ``_calculate_single_rank_operations``)."""
    spec, name = schedule_spec(schedule), schedule.lower()
    m = microbatches
    if spec.placement == "single":
        if name == "gpipe":
            return [(rank, "F", k) for k in range(m)] + [(rank, "B", k) for k in range(m)]
        warmup = min(m, pp_size - rank)  # torch's Schedule1F1B: then B, F alternate, then the last Bs
        steady = [a for k in range(m - warmup) for a in ((rank, "B", k), (rank, "F", warmup + k))]
        return ([(rank, "F", k) for k in range(warmup)] + steady
                + [(rank, "B", k) for k in range(m - warmup, m)])
    rounds = max(1, m // pp_size)
    fields = types.SimpleNamespace(pp_group_size=pp_size, n_local_stages=stages, _n_microbatches=m,
                                   number_of_rounds=rounds, microbatches_per_round=m // rounds, rank=rank,
                                   num_stages=pp_size * stages, _num_stages=pp_size * stages,
                                   _stages=[None] * stages)
    actions = []
    for action in spec.torch_class._calculate_single_rank_operations(fields, rank):
        for one in (action.sub_actions or (action,)) if action is not None else ():
            actions.append((one.stage_index, one.computation_type.value, one.microbatch_index))
    return actions


def in_flight(schedule: str, *, pp_size: int, microbatches: int, virtual_stages: int | None = None,
              layers: tuple[int, ...] | None = None) -> tuple[dict[int, int], ...]:
    """Per PP rank, ``{stage: micro-batches}`` whose activations its stages hold at once at the
    rank's peak (the most blocks' worth: ``layers[s]`` blocks on stage ``s``, default 1 each).

    A micro-batch is in flight on a stage from its forward to the backward that frees its
    saved tensors: the whole backward (``B``), or for the zero-bubble schedules, which split it,
    the weight pass (``W``), which still needs the saved inputs of every linear layer. Read off
    the order each schedule runs (:func:`_rank_actions`); in closed form (``P`` ranks, ``M``
    micro-batches, stage ``s``):

    - GPipe: ``M`` on every stage (every forward before any backward).
    - 1F1B: ``min(M, P - s)``: ``P`` on stage 0, 1 on the last (torch's warm-up forwards).
    - looped-bfs: ``M`` on each of a rank's ``V`` stages: every forward of the step comes
      before its first backward (the most of any schedule: ``V M`` micro-batch-stages).
    - interleaved-1f1b: torch's warm-up, ``min((V-1) R + 2(P-1-r), V M)`` forwards on rank ``r``
      (``R`` micro-batches a round: ``M / max(1, M // P)``), plus the one its first steady step
      runs, over the rank's stages in round-robin order (``P = 4``, ``M = 8``, rank 0: 7 + 4).
    - interleaved-zb: the same with a warm-up of ``(V-1) R + (P-1-r)``, each micro-batch held
      until its weight pass, which the schedule runs late: ``R`` on each stage at ``M >= P``.
    - zbv: ``2P`` micro-batch-stages on every rank (rank ``r``: ``2(P-r) - 1`` warm-up forwards on
      its first stage, then the second stage's, each freed by its weight pass); dualpipev:
      ``2P + 1`` (its overlapped forward-backward pairs run the forward first).

    Example::

        in_flight("1f1b", pp_size=4, microbatches=8)   # ({0: 4}, {1: 3}, {2: 2}, {3: 1})
    """
    check_microbatches(schedule, microbatches=microbatches, pp_size=pp_size, virtual_stages=virtual_stages)
    per_rank = stages_per_rank(schedule, virtual_stages)
    layout = stage_layout(pp_size * per_rank, pp_size=pp_size, schedule=schedule, virtual_stages=virtual_stages)
    weight = layers or (1,) * layout.num_stages
    peaks = []
    for rank in range(pp_size):
        held = {stage: 0 for stage in layout.stages_of(rank)}
        best, best_weight = dict(held), -1
        for stage, kind, _ in _rank_actions(schedule, pp_size=pp_size, microbatches=microbatches,
                                            stages=per_rank, rank=rank):
            held[stage] += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
            total = sum(weight[s] * n for s, n in held.items())
            if total > best_weight:
                best, best_weight = dict(held), total
        peaks.append(best)
    return tuple(peaks)


def pipeline_cost(cfg: CommConfig, *, pp_size: int, schedule: str = "1f1b", virtual_stages: int | None = None,
                  microbatches: int) -> PipelineCost:
    """The point-to-point traffic and bubble of one step of ``cfg``'s GPT (``cfg.layers``
    blocks, micro-batches of ``cfg.batch`` sequences) over ``pp_size`` ranks; a
    UsageError for a layout or micro-batch count the schedule cannot run."""
    layout = stage_layout(cfg.layers, pp_size=pp_size, schedule=schedule, virtual_stages=virtual_stages)
    bubble, formula = bubble_fraction(schedule, pp_size=pp_size, microbatches=microbatches,
                                      virtual_stages=virtual_stages)
    # Each TP rank sends its own copy of the hidden states, [s, b, h]; under SP its sequence
    # slice (the GPT pads a sequence SP does not split evenly).
    seq = -(-cfg.seq_len // cfg.tp) if cfg.sp else cfg.seq_len
    shape = (seq, cfg.batch, cfg.hidden)
    ranks = []
    for rank in range(pp_size):
        stages = layout.stages_of(rank)
        to_next = microbatches * sum(_remote(layout, s, s + 1) for s in stages)
        to_previous = microbatches * sum(_remote(layout, s, s - 1) for s in stages)
        # Forward: activations to the next stage, from the previous; backward: the reverse.
        ranks.append(RankTraffic(rank, stages, activation_sends=to_next, gradient_sends=to_previous,
                                 activation_recvs=to_previous, gradient_recvs=to_next))
    return PipelineCost(schedule.lower(), pp_size, layout.num_stages // pp_size, microbatches, layout, shape,
                        cfg.torch_dtype, seq * cfg.batch * cfg.hidden * cfg.element_size, tuple(ranks),
                        bubble, formula)


def _stage_of(op: CommOp, layout: StageLayout) -> int | None:
    """The stage whose module issues TP collective ``op`` (None: the training loop's, after the step)."""
    block = re.match(r"blocks\.(\d+)\.", op.layer)
    if block:
        return next(s for s, layers in enumerate(layout.layers) if int(block.group(1)) in layers)
    if op.phase == "grads":
        return None
    return 0 if op.layer.startswith("embedding") else layout.num_stages - 1


def rank_collectives(cfg: CommConfig, cost: PipelineCost, rank: int, *, tied: bool = True,
                     link: LinkModel | None = None) -> list[CommOp]:
    """Every collective PP rank ``rank`` issues in a step of ``cost``'s pipeline after the first
    (the first also exchanges shapes), as ``tensorpar train --pp`` runs it with its fp32
    ``main_grad`` (DP 1): per micro-batch its stages' TP collectives and sends and receives, then
    each stage's SP-gradient sum over TP, the tied embedding's gradient summed over the embedding
    group (``tied``, first and last stage on different ranks), the micro-batch losses broadcast
    from the last stage and the grad norm over TP and PP. Grouped by stage and micro-batch, not in
    the schedule's order (which interleaves them); ``link`` decides ``overlap_chunks="auto"``."""
    layout, m, fp32 = cost.layout, cost.microbatches, torch.float32
    last = layout.num_stages - 1

    def op(layer, phase, kind, shape, dtype, what, group, size, reduce_op="sum"):
        return GroupOp(layer, phase, kind, tuple(shape), dtype, cfg.tp, what, reduce_op, group=group, size=size)

    def p2p(stage, phase, kind, what):
        return [op(f"stage {stage}", phase, kind, cost.send_shape, cost.dtype, what, "pp", 2, None)] * m

    tp_ops = collectives(cfg, link=link)
    ops: list[CommOp] = []
    for s in layout.stages_of(rank):
        if _remote(layout, s, s - 1):
            ops += p2p(s, "forward", "recv", f"activations from stage {s - 1}")
            ops += p2p(s, "backward", "send", f"their gradient to stage {s - 1}")
        ops += [tp for tp in tp_ops if _stage_of(tp, layout) == s] * m
        if _remote(layout, s, s + 1):
            ops += p2p(s, "forward", "send", f"activations to stage {s + 1}")
            ops += p2p(s, "backward", "recv", f"their gradient from stage {s + 1}")
    for s in layout.stages_of(rank):
        if cfg.sp and cfg.tp > 1:  # as comm_model counts them, this stage's share
            numel = (len(layout.layers[s]) * 6 + 2 * (s == last)) * cfg.hidden + cfg.seq_len * cfg.hidden * (s == 0)
            ops.append(op(f"stage {s}", "grads", "all_reduce", (numel,), fp32, "sequence-parallel param grads",
                          "tp", cfg.tp))
    ends = (layout.rank_of(0), layout.rank_of(last))
    if tied and last and ends[0] != ends[1] and rank in ends:
        ops.append(op("embedding.word", "grads", "all_reduce", (-(-cfg.vocab // cfg.tp), cfg.hidden), fp32,
                      "tied embedding grad: first + last stage", "embedding", 2))
    ops.append(op("loss", "grads", "broadcast", (m,), torch.float64, "micro-batch losses from the last stage",
                  "pp", cost.pp_size, None))
    if cfg.tp > 1:
        ops.append(op("grad_norm", "grads", "all_reduce", (), fp32, "grad norm", "tp", cfg.tp))
    return ops + [op("grad_norm", "grads", "all_reduce", (), fp32, "grad norm over the stages", "pp", cost.pp_size)]
def pipeline_memory(config, *, pp_size: int, schedule: str = "1f1b", microbatches: int,
                    virtual_stages: int | None = None, layers_per_stage=None, **sizes) -> list[dict]:
    """Per PP rank, :func:`tensorpar.planning.memory.gpt_training_memory` of the stages it holds
    (the :func:`~.plan.stage_layout` of ``config.num_layers``) with the micro-batches
    :func:`in_flight` puts on each, plus ``rank``, ``stages`` and ``in_flight``; ``sizes`` are
    ``gpt_training_memory``'s (``tp``, ``dp``, ``seq_len``, ``micro_batch``, ``dtype``, ``fsdp``, ``cp``).

    Example::

        ranks = pipeline_memory(config, pp_size=2, microbatches=4, tp=1, seq_len=1024, micro_batch=1)
        largest = max(ranks, key=lambda r: r["total"])
        largest["rank"], largest["in_flight"]                # e.g. 0, {0: 2}: stage 0, 2 micro-batches
    """
    layout = stage_layout(config.num_layers, pp_size=pp_size, schedule=schedule, virtual_stages=virtual_stages,
                          layers_per_stage=layers_per_stage)
    counts = in_flight(schedule, pp_size=pp_size, microbatches=microbatches, virtual_stages=virtual_stages,
                       layers=tuple(len(r) for r in layout.layers))
    last = layout.num_stages - 1
    # The V schedules hold the first and the last stage on one rank: one embedding parameter for both.
    shared = config.tie_word_embeddings and layout.rank_of(0) == layout.rank_of(last)
    ranks = []
    for rank, held in enumerate(counts):
        shares = tuple(StageShare(len(layout.layers[s]), first=s == 0, last=s == last, in_flight=held[s],
                                  microbatches=microbatches, tied_here=shared and rank == layout.rank_of(0))
                       for s in layout.stages_of(rank))
        ranks.append({"rank": rank, "stages": layout.stages_of(rank), "in_flight": held,
                      **gpt_training_memory(config, stages=shares, **sizes)})
    return ranks
