"""Compiled dropout's masks on CPU: a rank's own part drawn against the whole mask drawn and
sliced, one process, one thread::

    python benchmarks/dropout_masks.py [--tp 2 4 8] [--batch 4 --heads 8 --seq 128 --hidden 256]

For each TP size, the masks one rank keeps, drawn as a compiled graph draws them on CPU from
its seed: the attention mask of its heads (``context.attention_dropout.keep_mask``: each global
head's blocks) and, under SP, the hidden mask of its rows (``keep_masks.traced_block_keep_mask``:
the blocks its rows fall in); against the same masks as traced dropout draws them elsewhere,
and drew them on CPU before (``keep_masks.traced_keep_mask``: the whole mask, of which the rank
keeps a copy of its slice). Timed in alternating rounds; prints the median milliseconds of each
and own / whole per round (its median and interquartile range).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from compile_step import _quartiles


def _ms(draw, iters: int) -> float:
    began = time.perf_counter()
    for _ in range(iters):
        draw()
    return 1e3 * (time.perf_counter() - began) / iters


def _masks(args, tp: int) -> dict:
    """The two ways of drawing each mask of one rank (rank 0; every rank draws as much)."""
    from tensorpar.context_parallel import attention_dropout
    from tensorpar.tensor_parallel.keep_masks import graph_seed, traced_block_keep_mask, traced_keep_mask

    heads, rows, keep = args.heads // tp, args.seq // tp, 1.0 - args.p
    attention = [args.batch, heads, args.seq, args.seq]
    hidden = [rows, args.batch, args.hidden]
    return {
        "attention": (lambda: attention_dropout.keep_mask(graph_seed(), args.p, batch=args.batch, heads=range(heads),
                                                          rows=[(0, args.seq)], seq_len=args.seq, keys=args.seq),
                      lambda: traced_keep_mask(attention, keep, "cpu", dim=1, start=0, full=args.heads)),
        "hidden rows (SP)": (lambda: traced_block_keep_mask(hidden, keep, "cpu", [(0, rows)], args.seq),
                             lambda: traced_keep_mask(hidden, keep, "cpu", dim=0, start=0, full=args.seq)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    for name, value in (("--tp", min(args.tp)), ("--heads", args.heads), ("--seq", args.seq)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    bad = [tp for tp in args.tp if args.heads % tp or args.seq % tp]
    if bad:
        parser.error(f"--tp {bad} must divide --heads ({args.heads}) and --seq ({args.seq})")
    torch.set_num_threads(1)
    results = {"args": vars(args)}
    for tp in args.tp:
        for mask, (own, whole) in _masks(args, tp).items():
            shapes = own().shape, whole().shape  # first calls (the ops' registration, allocator) left out
            if shapes[0] != shapes[1]:
                raise SystemExit(f"TP {tp}, {mask}: the two draws differ in shape: {shapes}")
            times = {"own": [], "whole": []}
            for round_ in range(args.rounds):
                for side, draw in (("own", own), ("whole", whole))[::1 if round_ % 2 == 0 else -1]:
                    times[side].append(_ms(draw, args.iters))
            ratios = [a / b for a, b in zip(times["own"], times["whole"])]
            results[f"TP {tp}, {mask}"] = {"own_ms": round(statistics.median(times["own"]), 3),
                                           "whole_ms": round(statistics.median(times["whole"]), 3),
                                           "own_over_whole_q1_median_q3": _quartiles(ratios)}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
