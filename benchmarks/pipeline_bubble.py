"""Pipeline step time against PP=1, and the measured bubble against the cost model's, in one run::

    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 4 8

One training step (forward and backward of ``M`` micro-batches, the gradients accumulated) of
the same GPT, on ``--pp`` local gloo ranks, one thread each:

- **PP=1**: the whole model on rank 0 alone, the micro-batches one after another (the other
  ranks wait at a barrier, idle): ``T1``.
- **PP=P**, for each schedule (``--schedules``): ``PipelinedGPT`` cut into P stages
  (``tensorpar train --pp``'s module), the step's slowest rank: ``TP_``.

Each round runs every variant in turn after ``--warmup`` untimed steps; reported are medians
over ``--rounds`` of per-round ratios (the slow drift of shared cores cancels out):
**speed-up** = ``T1 / TP_``; **measured bubble** = ``1 - T1 / (P x TP_)``, the share of the P
ranks' time not spent on the PP=1 work (bubble, P2P sends and stage imbalance together);
**predicted** = ``tensorpar.pipeline_parallel.bubble_fraction`` (bubble only). Before timing, each
schedule's first step's loss is checked against PP=1's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from gpt_step import slowest_rank


def _batches(args, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(m)
    rows = torch.randint(0, args.vocab, (m, args.batch, args.seq + 1), generator=generator)
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def _pp1_step(model, batches):
    def step():
        model.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, labels in batches:
            loss = model(tokens, labels)
            loss.backward()
            total += float(loss.detach())
        return total

    return step


def _pp_step(model, reducer, batches):
    def step():
        model.zero_grad(set_to_none=True)
        reducer.zero_grad()
        total = model.train_step(batches, reducer=reducer, dtype="fp32")
        reducer.finish()
        return float(total.sum())

    return step


def _virtual_stages(schedule: str) -> int | None:
    return 2 if schedule == "interleaved-1f1b" else None


def _timed(step, iters: int) -> float:
    """Median seconds of ``iters`` steps on this rank, after a barrier."""
    times = []
    for _ in range(iters):
        dist.barrier()
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def run(args) -> dict:
    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig
    from tensorpar.planning.pipeline import bubble_fraction
    from tensorpar.training.pipeline_step import PipelinedGPT

    tp.initialize_model_parallel(1, args.pp)
    config = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, num_layers=args.layers, num_heads=args.heads,
                       hidden_size=args.hidden)
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    results = {}
    for m in args.microbatches:
        batches = _batches(args, m)
        tp.model_parallel_manual_seed(0, tp_group=alone)
        reference = GPT(config, tp_group=alone) if rank == 0 else None
        steps = {"pp1": _pp1_step(reference, batches) if rank == 0 else None}
        expected = torch.tensor(steps["pp1"]() if rank == 0 else 0.0, dtype=torch.float64)
        dist.broadcast(expected, 0)
        for schedule in args.schedules:
            tp.model_parallel_manual_seed(0)
            model = PipelinedGPT(config, schedule=schedule, microbatches=m, virtual_stages=_virtual_stages(schedule),
                                 device=torch.device("cpu"))
            reducer = tp.DataParallelGradReducer(model.parameters(), dp_group=tp.get_data_parallel_group())
            steps[schedule] = _pp_step(model, reducer, batches)
            first = steps[schedule]()
            assert abs(first - float(expected)) <= 1e-5 * abs(float(expected)), (schedule, m, first, float(expected))
        times = {name: [] for name in steps}
        for round_ in range(args.rounds):
            order = list(steps)[round_ % len(steps):] + list(steps)[:round_ % len(steps)]
            for name in order:
                if name == "pp1" and rank != 0:  # idle: meet rank 0's barriers one for one
                    for _ in range(args.iters):
                        dist.barrier()
                    mine = 0.0
                else:
                    for _ in range(args.warmup):
                        steps[name]()
                    mine = _timed(steps[name], args.iters)
                times[name].append(slowest_rank([mine])[0])
        row = {}
        for schedule in args.schedules:
            speedups = [t1 / tp_ for t1, tp_ in zip(times["pp1"], times[schedule])]
            bubbles = [1 - s / args.pp for s in speedups]
            predicted, _ = bubble_fraction(schedule, pp_size=args.pp, microbatches=m,
                                           virtual_stages=_virtual_stages(schedule))
            row[schedule] = {"step_s": round(statistics.median(times[schedule]), 4),
                             "speedup_vs_pp1": round(statistics.median(speedups), 3),
                             "speedup_range": [round(min(speedups), 3), round(max(speedups), 3)],
                             "measured_bubble": round(statistics.median(bubbles), 3),
                             "predicted_bubble": None if predicted is None else round(predicted, 3)}
        results[f"M={m}"] = {"pp1_step_s": round(statistics.median(times["pp1"]), 4), **row}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved-1f1b"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    from tensorpar.cli.launch import launch_local

    load_before = os.getloadavg()[0]
    results = launch_local(run, args, nproc=args.pp)
    print(json.dumps({"args": vars(args), "load_1min": [load_before, os.getloadavg()[0]], **results[0]}, indent=1))


if __name__ == "__main__":
    main()
