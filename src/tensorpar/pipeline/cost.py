"""The analytic cost of a pipeline step: the bytes of each activation send between stages, the
sends and receives of each rank per step, and the schedule's bubble fraction.

Pure arithmetic on a :class:`tensorpar.comm_model.CommConfig` (``batch`` is the micro-batch
size; ``dtype`` the dtype of the hidden states between blocks: the parameters' dtype, so fp32
under ``tensorpar train --dtype bf16``'s autocast of fp32 weights). It counts what
:class:`tensorpar.pipeline.TorchStage` records in a ``CommLedger`` in a step after the first.

Example (GPT at hidden 4096, seq 2048, bf16, PP=2, 1F1B, 4 micro-batches)::

    cost = pipeline_cost(CommConfig(layer="gpt-step", tp=1), pp_size=2, schedule="1f1b", microbatches=4)
    cost.send_shape, cost.bytes_per_send    # (2048, 1, 4096), 16777216
    [r.sends for r in cost.ranks]           # [4, 4]: rank 0 its activations, rank 1 their gradients
    cost.bubble                             # 0.2 = (2 - 1) / (4 + 2 - 1)
"""

from __future__ import annotations

import dataclasses

import torch

from ..comm_model import CommConfig
from .plan import StageLayout, check_microbatches, schedule_spec, stage_layout, stages_per_rank

# Why the zero-bubble and DualPipeV schedules get no number: their bubble depends on how the
# backward's time splits into the input gradient (B) and the weight gradient (W), which this
# model does not know. With F = B = W the zero-bubble schedules have (nearly) none (Qi et al.,
# "Zero Bubble Pipeline Parallelism", ICLR 2024, and "Pipeline Parallelism with Controllable
# Memory", 2024, for ZB-V); DualPipe's is (PP/2 - 1)(F&B + B - 3W) (DeepSeek-V3 technical
# report, 2024, table 2), DualPipeV being its V-shaped half.
NOT_MODELLED = "not modelled: it depends on the backward's split into input and weight gradients"


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
    last = layout.num_stages - 1

    def remote(stage: int, neighbour: int) -> int:
        """1 if ``neighbour`` is a stage on another rank (neighbours on one rank call each other)."""
        return int(0 <= neighbour <= last and layout.rank_of(neighbour) != layout.rank_of(stage))

    ranks = []
    for rank in range(pp_size):
        stages = layout.stages_of(rank)
        to_next = microbatches * sum(remote(s, s + 1) for s in stages)
        to_previous = microbatches * sum(remote(s, s - 1) for s in stages)
        # Forward: activations to the next stage, from the previous; backward: the reverse.
        ranks.append(RankTraffic(rank, stages, activation_sends=to_next, gradient_sends=to_previous,
                                 activation_recvs=to_previous, gradient_recvs=to_next))
    return PipelineCost(schedule.lower(), pp_size, layout.num_stages // pp_size, microbatches, layout, shape,
                        cfg.torch_dtype, seq * cfg.batch * cfg.hidden * cfg.element_size, tuple(ranks),
                        bubble, formula)
