"""The TP-invariant mode's cost: a GPT training step with ``tp_invariant=True`` against the
default mode, in one run at one TP size (step-time ratio, and each mode's CommLedger bytes).

The two models are timed in alternating rounds (one step of each, the first of the pair
alternating too), so both see the same load on shared cores::

    python benchmarks/tp_invariant.py --tp 2 [--dp 1] [--sp] [--dtype fp32|bf16] [--steps 16] [--attention-dropout 0.1]
    python benchmarks/tp_invariant.py --tp 3 --invariant-blocks 24 --heads 6 --hidden 384

``--dp N`` runs TP x N ranks, each DP rank its own batch, the gradients reduced over DP as
``tensorpar train`` reduces them in each mode (the invariant mode: one micro-batch per rank in
the fixed tree over the DP ranks).

One step is ``gpt_step.py``'s (what ``tensorpar train`` runs), attention dropout 0 in both
modes unless ``--attention-dropout P``: then both modes drop attention probabilities (the
default mode inside SDPA, the invariant mode with per-head masks and explicit attention), a
third model runs the invariant mode without it, and ``attention_dropout_cost`` is the median
round ratio of the invariant mode with / without attention dropout. The ratio is the median
over rounds of the round's invariant / default time, each the slowest rank's; the 1-minute load average before and after
is printed with it. Bytes are what each rank sends under ring algorithms
(``CommRecord.bytes_sent_per_rank``), per op, for one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_step import add_arguments, add_step_counts, build_step, slowest_rank, timed  # noqa: E402


def run(args) -> dict:
    import tensorpar as tp

    tp.initialize_model_parallel(args.tp)  # DP: the other ranks
    modes = ("default", "tp_invariant") + (("tp_invariant_no_attention_dropout",) if args.attention_dropout else ())
    invariant = {"tp_invariant": True, "invariant_blocks": args.invariant_blocks}
    steps = {mode: build_step(args, attention_dropout=0.0 if mode.endswith("no_attention_dropout")
                              else args.attention_dropout, **(invariant if mode != "default" else {}))[0]
             for mode in modes}
    sent = {}
    for mode, step in steps.items():
        for _ in range(args.warmup):
            step()
        with tp.CommLedger() as ledger:
            step()
        per_op = defaultdict(float)
        for record in ledger.records:
            per_op[record.op] += record.bytes_sent_per_rank
        sent[mode] = {"total": sum(per_op.values()), "collectives": len(ledger.records), **per_op}
    times = {mode: [] for mode in modes}
    for round_ in range(args.steps):
        for mode in modes[::-1] if round_ % 2 else modes:
            times[mode].append(timed(steps[mode]))
    worst = {mode: slowest_rank(values) for mode, values in times.items()}
    ratios = [inv / default for inv, default in zip(worst["tp_invariant"], worst["default"])]
    out = {"step_s": {mode: statistics.median(values) for mode, values in worst.items()},
           "step_time_ratio": statistics.median(ratios), "round_ratios": [round(r, 3) for r in ratios],
           "bytes_sent_per_rank": sent}
    if args.attention_dropout:
        out["attention_dropout_cost"] = statistics.median(
            [a / b for a, b in zip(worst["tp_invariant"], worst["tp_invariant_no_attention_dropout"])])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, dtype="fp32")
    add_step_counts(parser)
    parser.add_argument("--attention-dropout", type=float, default=0.0, help="in both modes (default 0)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--invariant-blocks", type=int, default=8,
                        help="the invariant mode's fixed blocks (default 8; 24 for --tp 3 or 6)")
    args = parser.parse_args()
    from tensorpar.cli.launch import launch_local

    load_before = os.getloadavg()[0]
    out = launch_local(run, args, nproc=args.tp * args.dp)[0]
    sent = out.pop("bytes_sent_per_rank")
    print(json.dumps({"args": vars(args), **out, "load_1min": [load_before, os.getloadavg()[0]],
                      "bytes_sent_per_rank": sent,
                      "bytes_ratio": sent["tp_invariant"]["total"] / max(sent["default"]["total"], 1)}))


if __name__ == "__main__":
    main()
