"""A run's learning-rate schedule and batch: settled from the flags, the resumed run or the
defaults, and the learning rate at each step.

Example::

    settle_run(args, meta=None, dp_size=2)     # fills args.lr, args.global_batch, args.grad_accum, ...
    lr = lr_at(step, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, total=args.lr_decay_steps)
"""

from __future__ import annotations

import math

from ..errors import UsageError
from ..distributed.tree_reduce import subtree_sizes

DEFAULT_SCHEDULE = {"lr": 3e-3, "warmup": 30}
MIN_LR_FRACTION = 0.1  # --min-lr, unless given, is this fraction of --lr
DEFAULT_MICRO_BATCH = 16


def settle_run(args, *, meta: dict | None, dp_size: int) -> None:
    """Fill in the run's schedule and batch from the resumed run (``meta``) or the defaults; check them.

    ``--steps`` is the run's total, so a resumed run must still have steps to go. The learning
    rate schedule (``--lr``, ``--min-lr``, ``--warmup``, ``--lr-decay-steps``) is the resumed
    run's unless given; a fresh run decays over ``--steps``. The global batch (sequences per
    optimizer step) and the micro-batch are the resumed run's unless given, and gradient
    accumulation is what makes the global batch at this DP size (the invariant mode needs a DP size
    whose ranks sum subtrees of the step's micro-batches: a power of two dividing them). Idempotent: the ranks settle
    again what the command line settled.
    """
    start = meta["step"] if meta else 0
    if args.steps <= start:
        raise UsageError(f"--steps {args.steps} is the run's total, and the checkpoint is already at step "
                         f"{start}: pass --steps above {start} to train further")
    saved = (meta or {}).get("schedule", {})
    if args.min_lr is None and args.lr is None:  # a new --lr brings its own floor
        args.min_lr = saved.get("min_lr")
    for name, default in DEFAULT_SCHEDULE.items():
        if getattr(args, name) is None:
            setattr(args, name, saved.get(name, default))
    if args.min_lr is None:
        args.min_lr = float(f"{args.lr * MIN_LR_FRACTION:.12g}")  # 3e-4 of 3e-3, not 0.00030000000000000003
    if args.lr_decay_steps is None:
        args.lr_decay_steps = saved.get("decay_steps", saved.get("steps", args.steps))
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}")

    micro = args.micro_batch or (meta or {}).get("micro_batch", DEFAULT_MICRO_BATCH)
    batch = args.global_batch or (meta or {}).get("global_batch") or micro * (args.grad_accum or 1) * dp_size
    what = ("--global-batch" if args.global_batch else "the resumed run's global batch"
            if (meta or {}).get("global_batch") else "the global batch")
    if batch % dp_size:
        raise UsageError(f"{what} {batch} cannot be split evenly over {dp_size} data-parallel ranks: "
                         f"choose --nproc/--tp so that the DP size divides {batch}")
    per_rank = batch // dp_size
    if args.micro_batch is None:  # the largest that fits, up to the default, in as many as a pipeline needs
        fits = [d for d in range(min(micro, per_rank), 0, -1) if per_rank % d == 0]
        runs = [d for d in fits if _schedule_runs(args, per_rank // d)] if args.grad_accum is None else []
        args.micro_batch = (runs or fits)[0]
        args.micro_batch_chosen = getattr(args, "pp", 1) > 1 and args.micro_batch != fits[0]
    elif per_rank % args.micro_batch:
        raise UsageError(f"{what} {batch} over {dp_size} data-parallel ranks is {per_rank} sequences "
                         f"per rank, not a multiple of --micro-batch {args.micro_batch}: choose a "
                         f"--micro-batch dividing {per_rank}")
    if args.interleave > args.micro_batch:
        raise UsageError(f"--interleave {args.interleave} splits each micro-batch into {args.interleave} parts, but "
                         f"--micro-batch is {args.micro_batch}: choose a --micro-batch of at least {args.interleave}")
    accum = batch // (dp_size * args.micro_batch)
    if args.grad_accum is not None and args.grad_accum != accum:
        raise UsageError(f"--grad-accum {args.grad_accum} x --micro-batch {args.micro_batch} x {dp_size} "
                         f"data-parallel ranks is {args.grad_accum * args.micro_batch * dp_size} sequences per "
                         f"step, not {what} {batch}: leave --grad-accum out to adapt it")
    args.global_batch, args.grad_accum = batch, accum
    sizes = subtree_sizes(batch // args.micro_batch)
    if getattr(args, "tp_invariant", False) and dp_size not in sizes:
        raise UsageError(f"--tp-invariant: {dp_size} data-parallel ranks cannot each sum a subtree of the "
                         f"{batch // args.micro_batch} micro-batches per step ({what} {batch} / --micro-batch "
                         f"{args.micro_batch}; halves, then chains of {batch // args.micro_batch // sizes[-1]}): "
                         f"use a DP size of {', '.join(map(str, sizes))}")


def _schedule_runs(args, microbatches: int) -> bool:
    """Whether the run's pipeline schedule (``--pp``, ``--pp-schedule``) takes ``microbatches`` a step."""
    if getattr(args, "pp", 1) == 1:
        return True
    from ..pipeline_parallel import check_microbatches

    try:
        check_microbatches(args.pp_schedule, microbatches=microbatches, pp_size=args.pp,
                           virtual_stages=args.virtual_stages)
    except UsageError:
        return False
    return True


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def schedule_note(args, *, start: int = 0) -> str | None:
    """What the learning rate does past what ``--lr`` says, as the log will show it (the log's step
    ``s`` trains at ``lr_at(s - 1)``): a run ending inside (or with) its warmup, a decay that ends inside the
    warmup (then there is none), or one that ends before the run does; None when the schedule
    runs its course over the run."""
    def shown(step: int) -> float:
        return lr_at(step - 1, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, total=args.lr_decay_steps)

    if args.steps < args.warmup:
        return (f"the run ends inside its warmup of {args.warmup} steps: the lr reaches {shown(args.steps):.3g} at "
                f"step {args.steps}, never --lr {args.lr:g}; pass --warmup below {args.steps} to reach it")
    if args.steps == args.warmup:
        return (f"the run ends with its warmup of {args.warmup} steps: the lr reaches {shown(args.steps):g} at step "
                f"{args.steps} and never decays; pass --warmup below {args.steps} for a decay")
    if args.lr_decay_steps <= args.warmup:
        return (f"--lr-decay-steps {args.lr_decay_steps} ends inside the warmup of {args.warmup} steps, so nothing "
                f"decays: steps {max(start, args.warmup) + 1}-{args.steps} train at {shown(args.steps):g}; to decay "
                f"over the run, pass --lr-decay-steps {args.steps}")
    if args.lr_decay_steps < args.steps:
        return (f"the schedule reaches --min-lr {args.min_lr:g} at step {args.lr_decay_steps + 1}, so steps "
                f"{max(start, args.lr_decay_steps) + 1}-{args.steps} train at {shown(args.steps):g}; to decay over "
                f"the whole run instead, pass --lr-decay-steps {args.steps}")
    return None
