"""``tensorpar train --num-experts E --moe-router-topk K --ep N``: the mixture-of-experts flags,
and what expert parallelism refuses before any process starts.

EP folds over the TP x CP x DP ranks of a stage (Megatron's folding, experts whole on each rank),
so ``--ep`` must divide ``--num-experts`` and TP x CP x DP.

Example::

    add_expert_flags(model_group)     # --num-experts, --moe-router-topk, ... and --ep
    check_experts(args, config, world=4)
"""

from __future__ import annotations

import argparse

from ..errors import UsageError
from .flag_types import number, positive


def add_expert_flags(parser) -> None:
    """The experts' shape and balance flags, and ``--ep``."""
    parser.add_argument("--num-experts", type=positive(int), default=None,
                        help="routed experts per MoE block (SwiGLU; default: the preset's, none for dense presets)")
    parser.add_argument("--moe-router-topk", type=positive(int), default=None,
                        help="experts each token is sent to (default: 2)")
    parser.add_argument("--moe-ffn-hidden", type=positive(int), default=None,
                        help="each expert's width (default: --ffn-hidden)")
    parser.add_argument("--moe-shared-ffn-hidden", type=positive(int), default=None,
                        help="width of a shared expert every token goes through (default: none)")
    parser.add_argument("--moe-first-dense-layers", type=number(int, low=0), default=None,
                        help="the first blocks keep a dense MLP, as DeepSeek-V3's (default: 0)")
    parser.add_argument("--moe-aux-loss-coeff", type=number(float, low=0), default=None,
                        help="weight of the load-balancing loss (default: the preset's, else 0)")
    parser.add_argument("--moe-expert-bias", action=argparse.BooleanOptionalAction, default=None,
                        help="auxiliary-loss-free balance: a per-expert bias moved once per step (default: off)")
    parser.add_argument("--ep", type=positive(int), default=1,
                        help="expert-parallel size: the experts of each MoE block split over this many of the "
                             "TP x CP x DP ranks, which route their own tokens to them (default: 1)")


def check_experts(args, config, *, world: int) -> None:
    """Refuse, in one line, an ``--ep`` or MoE run that ``config`` (the run's GPTConfig) cannot make."""
    ep = args.ep
    if config.num_moe_experts is None:
        if ep > 1:
            raise UsageError(f"--ep {ep} needs a model with experts: --num-experts, or --model moe-tiny")
        return
    experts = config.num_moe_experts
    if experts % ep:
        raise UsageError(f"--num-experts {experts} is not divisible by --ep {ep}: each EP rank holds whole experts")
    ranks = world // args.pp
    if ranks % ep:
        raise UsageError(f"--ep {ep} does not divide the {ranks} TP x CP x DP ranks of a stage "
                         f"(--tp {args.tp} x --cp {args.cp} x DP {ranks // (args.tp * args.cp)})")
    splitting = args.tp * args.cp  # the ranks of one micro-batch
    if config.tp_invariant and ep < splitting and experts % splitting:
        raise UsageError(f"--tp-invariant with --ep {ep} below --tp {args.tp} x --cp {args.cp} = {splitting} computes "
                         f"each expert on one of those {splitting} ranks: --num-experts {experts} must divide by "
                         f"{splitting}")
