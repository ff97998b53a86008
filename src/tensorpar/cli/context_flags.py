"""``tensorpar train --cp N [--cp-comm a2a|p2p]``: the flags, and what context parallelism
refuses before any process starts.

The world is TP x CP x DP in Megatron's order (TP fastest, then CP, then DP), so ``--nproc``
must be a multiple of ``--tp`` x ``--cp``. Whatever a CP run cannot do is refused in one line
naming the flags (:func:`check_context`), from the model config the run will build.

Example::

    add_context_flags(parser)                  # --cp, --cp-comm
    check_world(args, world, where="--nproc")  # --tp 2 x --cp 2 = 4 must divide the world
    check_context(args, config)                # e.g. --cp 2 with --compile: refused
"""

from __future__ import annotations

import argparse

from ..errors import UsageError
from .flag_types import positive


def add_context_flags(parser: argparse.ArgumentParser) -> None:
    """``--cp`` and ``--cp-comm``."""
    parser.add_argument("--cp", type=positive(int), default=1,
                        help="context-parallel size: each sequence split over this many ranks, which hold the same "
                             "weights; --nproc = TP x CP x DP x PP (default: 1)")
    parser.add_argument("--cp-comm", choices=("a2a", "p2p"), default="p2p",
                        help="how attention reaches the other CP ranks' tokens: a2a (Ulysses all-to-all, at least "
                             "one query head per TP x CP rank) or p2p (K/V passed around a ring; default)")


def check_world(args, world: int, *, where: str) -> None:
    """Refuse a world that TP x CP (x PP) does not divide (``where``: the flag or launcher that set it)."""
    pp = getattr(args, "pp", 1)
    model = args.tp * args.cp * pp
    sizes = f"--tp {args.tp} x --cp {args.cp}" + (f" x --pp {pp}" if pp > 1 else "")
    if model > world:
        raise UsageError(f"{sizes} needs at least {model} processes; {where} is {world}")
    if world % model:
        raise UsageError(f"{sizes} = {model} does not divide {where} {world}: "
                         "the world is TP x CP x DP" + (" x PP" if pp > 1 else ""))


def _unsupported(args, config) -> list[str]:
    """The flags (with their values) a CP run does not support."""
    bad = {"--compile": args.compile, f"--interleave {config.interleave}": config.interleave > 1}
    return [flag for flag, refused in bad.items() if refused]


def check_context(args, config) -> None:
    """Refuse, in one line, a ``--cp`` run that ``config`` (the run's GPTConfig) cannot make."""
    if args.cp == 1:
        return
    unsupported = _unsupported(args, config)
    if unsupported:
        raise UsageError(f"--cp {args.cp} does not combine with {', '.join(unsupported)} (not supported under "
                         "context parallelism); drop them, or train with --cp 1")
    heads = config.num_heads  # an uneven TP split's smallest rank holds heads // TP of them
    if args.cp_comm == "a2a" and heads // args.tp < args.cp:
        where = "on the smallest" if heads % args.tp else "per"
        raise UsageError(f"--cp-comm a2a needs at least one query head per TP x CP rank: the model's {heads} heads "
                         f"at --tp {args.tp} are {heads // args.tp} {where} TP rank, fewer than --cp {args.cp}; "
                         "use --cp-comm p2p, which has no such limit")
    from ..models.context_split import invariant_refusals  # torch: not for --help

    refused = invariant_refusals(config, tp_size=args.tp, cp_size=args.cp,
                                 sequence_parallel=config.sequence_parallel and args.tp > 1)
    if refused:
        raise UsageError(f"--tp-invariant with --cp {args.cp} cannot give the CP 1 bits with {'; '.join(refused)}")
