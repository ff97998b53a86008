"""``tensorpar train --fsdp [--dp-replicate R] [--fsdp-min-unit-mib MIB]``: the flags, and what
FSDP refuses before any process starts.

FSDP is a setting a resumed run keeps (``--no-fsdp`` turns it off); ``--dp-replicate R`` makes
it HSDP: the DP ranks as ``R`` replicas of ``DP / R`` shards (:func:`tensorpar.data_parallel.fsdp.hsdp_mesh`);
``--fsdp-min-unit-mib`` is :func:`tensorpar.fully_shard`'s ``min_unit_mib``.

Example::

    add_fsdp_flags(run)                 # --fsdp/--no-fsdp, --dp-replicate, --fsdp-min-unit-mib
    check_fsdp(args, config, dp=4, replicate_given=True)   # --dp-replicate 3 at DP 4: refused
"""

from __future__ import annotations

import argparse

from ..errors import UsageError
from .flag_types import non_negative, positive

# tensorpar.data_parallel.fsdp.MIN_UNIT_MIB, for --help without importing torch (a test keeps them equal).
MIN_UNIT_MIB = 25.0


def add_fsdp_flags(parser) -> None:
    """``--fsdp``/``--no-fsdp``, ``--dp-replicate`` and ``--fsdp-min-unit-mib``."""
    parser.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                        help="shard parameters, gradients and optimizer state over the data-parallel ranks "
                             "(FSDP2, ZeRO-3): --nproc N --tp T gives T-way TP and N/T-way FSDP (default: the "
                             "resumed run's, else off; --no-fsdp turns a resumed run's off)")
    parser.add_argument("--dp-replicate", type=positive(int), default=None, metavar="R",
                        help="with --fsdp: HSDP, the DP ranks as R replicas of DP/R shards each (FSDP2's 2-D "
                             "mesh); R must divide the DP size (default: the resumed run's, else 1)")
    parser.add_argument("--fsdp-min-unit-mib", type=non_negative(float), default=MIN_UNIT_MIB, metavar="MIB",
                        help="with --fsdp: consecutive transformer blocks make one FSDP unit until it holds MIB "
                             f"MiB of a rank's parameters; 0: a unit per block (default {MIN_UNIT_MIB:g}, DDP's "
                             "bucket size)")


def check_fsdp(args, config, *, dp: int, replicate_given: bool) -> None:
    """Refuse what FSDP cannot do here, in one line naming the values (``dp``: the DP size, x CP
    under CP; ``replicate_given``: ``--dp-replicate`` on the command line, not a resumed run's)."""
    if args.fsdp_min_unit_mib != MIN_UNIT_MIB and not args.fsdp:
        raise UsageError(f"--fsdp-min-unit-mib {args.fsdp_min_unit_mib:g} applies with --fsdp (the size of its units)")
    if replicate_given and args.dp_replicate > 1 and not args.fsdp:
        raise UsageError(f"--dp-replicate {args.dp_replicate} applies with --fsdp (HSDP: replicas of FSDP shards)")
    if args.fsdp and dp % args.dp_replicate:
        raise UsageError(f"--dp-replicate {args.dp_replicate} does not divide the DP size {dp}: HSDP needs DP/R "
                         "shards in each of R replicas")
    if args.fsdp and args.dp_replicate > 1 and args.pp > 1:
        raise UsageError(f"--dp-replicate {args.dp_replicate} with --pp {args.pp}: HSDP shards one pipeline "
                         "stage per rank only at --pp 1 so far")
    if args.fsdp and config.gradient_accumulation_fusion:
        raise UsageError("--fsdp cannot combine with gradient-accumulation fusion (--grad-fusion, or the resumed "
                         "run's setting): FSDP reduces the gradients itself; drop one of them")
    if args.fsdp and config.tp_invariant and config.num_moe_experts and args.pp > 1:
        raise UsageError(f"--fsdp with --tp-invariant, experts and --pp {args.pp}: a pipeline's expert gradients "
                         "under FSDP do not enter the mode's trees yet; drop --fsdp or --pp")
    if args.fsdp and config.tp_invariant and dp // args.dp_replicate == 1:
        over = "DP x CP" if args.cp > 1 else "DP"
        raise UsageError(f"--fsdp with --tp-invariant shards over {over} / --dp-replicate = {dp} / "
                         f"{args.dp_replicate} = 1 rank, whose FSDP reduces nothing in the mode's tree: use at least 2 "
                         "shards, or drop --fsdp")
