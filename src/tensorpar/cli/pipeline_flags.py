"""``tensorpar train``'s pipeline flags (``--pp``, ``--pp-schedule``, ``--virtual-stages``) and
their checks before launch: the world TP x PP divides, the stages the layers make, the
micro-batches the schedule runs, the schedules that keep ``--tp-invariant``'s bits, and what PP
does not combine with yet, one line each.

Example::

    add_flags(parser)                              # on the train parser
    check_world(args, world=8, where="--nproc")    # UsageError: --pp 3 does not divide --nproc 8
    check_run(args, config)                        # after the batch is settled (args.grad_accum)
"""

from __future__ import annotations

import argparse

from ..errors import UsageError
from .flag_types import positive

# tensorpar.pipeline_parallel.SCHEDULES' names, here without importing torch (``--help`` does not).
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
# The schedules whose first and last stage are on one rank (placement "v").
V_SCHEDULES = ("zbv", "dualpipev")

# What a pipeline run refuses: (the args attribute, the flag, why).
_NOT_WITH_PP = (
    ("compile", "--compile", "torch.compile of pipeline stages is not supported yet"),
    ("init_from_hf", "--init-from-hf", "loading a Hugging Face model into pipeline stages is not supported yet: "
                                       "train a step at --pp 1, then --resume at --pp N"),
)


def _given(value) -> bool:
    """Whether a flag's value asks for something (not its default: None, False, or a size of 1)."""
    return value is True or value not in (None, False, 1)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The pipeline flags, beside ``--tp``."""
    parser.add_argument("--pp", type=positive(int), default=1,
                        help="pipeline-parallel size: the layers cut into stages over PP ranks; --nproc is "
                             "TP x CP x DP x PP, ranks ordered TP fastest, then CP, DP, PP (default: 1)")
    parser.add_argument("--pp-schedule", choices=SCHEDULE_NAMES, default="1f1b",
                        help="torch.distributed.pipelining schedule with --pp; the step's micro-batches "
                             "(--grad-accum) are its micro-batches (default: 1f1b)")
    parser.add_argument("--virtual-stages", type=positive(int), default=None,
                        help="stages per rank for interleaved-1f1b, looped-bfs and interleaved-zb "
                             "(default: 2; zbv and dualpipev always hold 2)")


def check_world(args, *, world: int, where: str) -> None:
    """Refuse a ``--pp`` that ``world`` (named ``where``) cannot hold."""
    pp = getattr(args, "pp", 1)
    if pp > world:
        raise UsageError(f"--pp {pp} needs at least {pp} processes; {where} is {world}")
    if world % pp:
        raise UsageError(f"--pp {pp} does not divide {where} {world}")


def check_run(args, config) -> None:
    """Refuse, one line each, a pipeline run that cannot run (``args.grad_accum`` settled)."""
    pp = args.pp
    if pp == 1:
        if args.virtual_stages is not None:
            raise UsageError(f"--virtual-stages {args.virtual_stages} needs --pp greater than 1")
        return
    from ..pipeline_parallel import check_invariant, check_microbatches, require_torch_pipelining, stage_layout

    require_torch_pipelining()
    given = [(flag, why) for name, flag, why in _NOT_WITH_PP if _given(getattr(args, name, None))]
    if config.gradient_accumulation_fusion:
        given.append(("--grad-fusion", "gradient-accumulation fusion under PP is not supported yet"))
    if args.fsdp and config.tie_word_embeddings and args.pp_schedule in V_SCHEDULES:
        given.append((f"--fsdp with --pp-schedule {args.pp_schedule} and tied embeddings",
                      "its first and last stage share the embedding on one rank, which FSDP cannot shard "
                      "twice (--model llama-tiny has untied ones; or another schedule)"))
    if given:
        raise UsageError(f"--pp {pp} cannot combine with {' or '.join(f for f, _ in given)} (or the resumed "
                         f"run's setting): {'; '.join(why for _, why in given)}")

    what = f"--pp {pp} --pp-schedule {args.pp_schedule}"
    try:
        if config.tp_invariant:
            check_invariant(args.pp_schedule)
        stage_layout(config.num_layers, pp_size=pp, schedule=args.pp_schedule, virtual_stages=args.virtual_stages)
        check_microbatches(args.pp_schedule, microbatches=args.grad_accum, pp_size=pp,
                           virtual_stages=args.virtual_stages)
    except UsageError as exc:
        raise UsageError(f"{what}: {exc} (the micro-batches are the step's --grad-accum)"
                         if "micro-batches" in str(exc) else f"{what}: {exc}") from None
