"""Context-parallel training step time against plain data parallelism at the same total tokens::

    python benchmarks/context_step.py --nproc 2 --seq-len 1024

``tensorpar train`` on ``--nproc`` local gloo ranks (one thread each), three ways with the same
global batch of ``--global-batch`` sequences of ``--seq-len`` tokens, so every rank holds the
same number of tokens:

- **DP**: ``--cp 1``, each rank its own sequences (``--micro-batch`` = global / nproc);
- **CP a2a** and **CP p2p**: ``--cp N --cp-comm a2a|p2p``, every rank a chunk of every sequence.

Each run trains ``--steps`` steps and logs every step; a run's step time is the median over its
steps after ``--skip`` (warm-up), read from ``metrics.jsonl``'s ``tokens_per_s``. Rounds run the
three in rotated order; reported are the median over rounds of each CP mode's time / DP's
(above 1: CP is slower) with its range, and each variant's median step time. The 1-minute load
average before and after is printed with the figures: on shared cores a ratio is only as good
as the load was steady.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _step_s(args, extra: list[str], out: Path) -> float:
    """Median seconds per step of one ``tensorpar train`` run with ``extra`` flags."""
    command = [sys.executable, "-m", "tensorpar", "train", "--nproc", str(args.nproc), "--tp", "1",
               "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
               "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
               "--steps", str(args.steps), "--log-every", "1", "--eval-every", "0", "--save-every", "0",
               "--no-progress", "--out", str(out), *extra]
    subprocess.run(command, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = args.global_batch * args.seq_len
    return statistics.median(tokens / row["tokens_per_s"] for row in rows if row["step"] > args.skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    micro = str(args.global_batch // args.nproc)
    variants = {"dp": ["--cp", "1", "--micro-batch", micro],
                "cp a2a": ["--cp", str(args.nproc), "--cp-comm", "a2a", "--micro-batch", str(args.global_batch)],
                "cp p2p": ["--cp", str(args.nproc), "--cp-comm", "p2p", "--micro-batch", str(args.global_batch)]}
    load_before = os.getloadavg()[0]
    times = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            names = list(variants)
            for name in names[round_ % 3:] + names[:round_ % 3]:
                out = Path(tmp) / f"{name.replace(' ', '-')}-{round_}"
                times[name].append(_step_s(args, variants[name], out))
    ratios = {name: [t / dp for t, dp in zip(times[name], times["dp"])] for name in ("cp a2a", "cp p2p")}
    print(json.dumps({"args": vars(args), "load_1min": [load_before, os.getloadavg()[0]],
                      "step_s": {name: round(statistics.median(t), 4) for name, t in times.items()},
                      "vs_dp": {name: {"median": round(statistics.median(r), 3),
                                       "range": [round(min(r), 3), round(max(r), 3)]} for name, r in ratios.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
