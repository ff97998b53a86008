"""The plan of a pipeline run, checkable before any rank starts: the schedules, which blocks
each stage holds, which rank runs each stage, and the micro-batch counts a schedule can run.

Stage ``s`` of ``S = PP x V`` runs on PP rank ``s % PP`` (torch's and Megatron's interleaving:
rank ``r`` holds stages ``r, r + PP, ...``), or, for the V schedules, rank ``r`` holds stages
``r`` and ``2 PP - 1 - r`` (the first and the last stage on rank 0).

Example::

    layout = stage_layout(5, pp_size=2, schedule="1f1b")     # layers [0, 3) and [3, 5)
    check_microbatches("1f1b", microbatches=4, pp_size=2)     # UsageError if it cannot run
    check_invariant("zbv")                                    # UsageError: it cannot keep tp_invariant's bits
"""

from __future__ import annotations

import dataclasses

from torch.distributed import pipelining

from ..errors import UsageError
from ..tensor_parallel.initialization import balanced_sizes


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """One of torch's schedules: its class, and how stages sit on ranks (``single``: one per
    rank; ``loop``: ``V`` per rank, round robin; ``v``: two per rank, in a V)."""

    torch_class: type
    placement: str
    not_invariant: str | None = None  # why the schedule cannot keep tp_invariant's bits (None: it keeps them)


# torch's weight pass (stage_backward_weight) writes .grad itself, outside autograd's
# accumulation: no hook sees a micro-batch's weight gradient to put it in the fixed tree.
_SPLIT = ("it splits each backward into an input pass and a later weight pass that adds to .grad outside "
          "autograd, so no micro-batch's weight gradient can be put in the mode's fixed tree")

SCHEDULES = {
    "gpipe": ScheduleSpec(pipelining.ScheduleGPipe, "single"),
    "1f1b": ScheduleSpec(pipelining.Schedule1F1B, "single"),
    "interleaved-1f1b": ScheduleSpec(pipelining.ScheduleInterleaved1F1B, "loop"),
    "looped-bfs": ScheduleSpec(pipelining.ScheduleLoopedBFS, "loop"),
    "interleaved-zb": ScheduleSpec(pipelining.ScheduleInterleavedZeroBubble, "loop", _SPLIT),
    "zbv": ScheduleSpec(pipelining.ScheduleZBVZeroBubble, "v", _SPLIT),
    "dualpipev": ScheduleSpec(pipelining.ScheduleDualPipeV, "v", _SPLIT),
}


def schedule_spec(schedule: str) -> ScheduleSpec:
    """The spec of ``schedule`` (case-insensitive), or a UsageError naming the choices."""
    spec = SCHEDULES.get(schedule.lower()) if isinstance(schedule, str) else None
    if spec is None:
        raise UsageError(f"unknown pipeline schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    return spec


def check_invariant(schedule: str) -> None:
    """Raise a UsageError naming why if ``schedule`` cannot run ``tp_invariant=True`` bit for bit."""
    why = schedule_spec(schedule).not_invariant
    if why is not None:
        keeps = ", ".join(name for name, spec in SCHEDULES.items() if spec.not_invariant is None)
        raise UsageError(f"the {schedule.lower()} schedule cannot keep the invariant mode's bits: {why}; "
                         f"use {keeps}")


def stages_per_rank(schedule: str, virtual_stages: int | None) -> int:
    """How many stages each rank holds under ``schedule`` (default 2 for the multi-stage ones)."""
    placement = schedule_spec(schedule).placement
    if virtual_stages is not None and (isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int)
                                       or virtual_stages < 1):
        raise UsageError(f"virtual stages must be a positive int, got {virtual_stages!r}")
    if placement == "single":
        if virtual_stages not in (None, 1):
            raise UsageError(f"{virtual_stages} virtual stages need a multi-stage schedule (interleaved-1f1b, "
                             f"looped-bfs, interleaved-zb, zbv, dualpipev), not {schedule}")
        return 1
    if placement == "v":
        if virtual_stages not in (None, 2):
            raise UsageError(f"the {schedule} schedule holds exactly 2 stages per rank, got {virtual_stages}")
        return 2
    return 2 if virtual_stages is None else virtual_stages


def check_microbatches(schedule: str, *, microbatches: int, pp_size: int, virtual_stages: int | None = None) -> None:
    """Raise a UsageError naming the requirement if ``schedule`` cannot run ``microbatches``
    micro-batches over ``pp_size`` ranks (torch's own checks, and those it leaves to a hang)."""
    stages = pp_size * stages_per_rank(schedule, virtual_stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise UsageError(f"micro-batches must be a positive int, got {microbatches!r}")
    name = schedule.lower()
    rounds = max(1, microbatches // pp_size)
    if name == "1f1b" and microbatches < pp_size:
        need = f"at least PP = {pp_size} micro-batches"
    elif name == "dualpipev" and microbatches < stages:
        need = f"at least 2 x PP = {stages} micro-batches"
    elif name in ("interleaved-1f1b", "interleaved-zb") and microbatches % rounds:
        need = (f"a micro-batch count that is a multiple of its rounds, max(1, micro-batches // PP) = {rounds} "
                f"(e.g. {rounds * pp_size} or {(rounds + 1) * pp_size})")
    else:
        return
    raise UsageError(f"the {name} schedule at PP={pp_size} needs {need}, got {microbatches}")


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """The blocks of each stage (``layers[s]``) and the placement of stages on the PP ranks."""

    layers: tuple[range, ...]
    pp_size: int
    placement: str

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def rank_of(self, stage: int) -> int:
        """The PP rank that runs ``stage``."""
        if self.placement == "v" and stage >= self.pp_size:
            return 2 * self.pp_size - 1 - stage
        return stage % self.pp_size

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages PP rank ``rank`` holds, in order."""
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)

    def describe(self) -> str:
        """One line naming each stage's blocks, e.g. ``stage 0 (PP rank 0): layers 0-2``."""
        return ", ".join(f"stage {s} (PP rank {self.rank_of(s)}): layers {r.start}-{r.stop - 1}"
                         for s, r in enumerate(self.layers))


def stage_layout(num_layers: int, *, pp_size: int, schedule: str, virtual_stages: int | None = None,
                 layers_per_stage=None) -> StageLayout:
    """Cut ``num_layers`` blocks into ``pp_size x`` (stages per rank) contiguous stages: as even
    as possible, the larger first (5 on 2: 3 + 2), or ``layers_per_stage`` (one count per stage)."""
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise UsageError(f"the pipeline-parallel size must be a positive int, got {pp_size!r}")
    stages = pp_size * stages_per_rank(schedule, virtual_stages)
    if layers_per_stage is None:
        if stages > num_layers:
            raise UsageError(f"{stages} pipeline stages (PP={pp_size} x {stages // pp_size} per rank) exceed the "
                             f"{num_layers} layers: every stage needs a layer")
        counts = balanced_sizes(num_layers, stages)
    else:
        counts = list(layers_per_stage)
        if len(counts) != stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts) \
                or sum(counts) != num_layers:
            raise UsageError(f"layers per stage must be {stages} positive ints (one per stage) summing to the "
                             f"{num_layers} layers, got {list(layers_per_stage)!r}")
    starts = [sum(counts[:s]) for s in range(stages)]
    return StageLayout(tuple(range(a, a + c) for a, c in zip(starts, counts)), pp_size,
                       schedule_spec(schedule).placement)
