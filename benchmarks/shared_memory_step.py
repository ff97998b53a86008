"""The eager GPT training step with its exchanges through shared memory, against the same step
with them over gloo's sockets, in one process tree::

    python benchmarks/shared_memory_step.py --tp 2 [--hidden 1024 --seq 512 --layers 2]

The step is ``gpt_step.py``'s (forward, loss, backward, DP grad reduction, SP grad sum, clipping,
AdamW), at one TP size without and with SP. Three ways its collectives travel, taking turns in
every round (the order rotates) on the same model: as tensorpar sends them ("tensorpar": through
the group's shared memory, an all-gather or all-reduce up to
``gloo_transport.SHARED_MEMORY_MAX_BYTES``); the same with only what gloo's all-to-all would
take exchanged, the rest gloo's own ("all-to-all limit"); and with no shared memory, the
exchanges as gloo's all-to-all ("sockets"). Reported per variant: each way's median step time
(the slowest rank's) and the per-round ratios of tensorpar's time to the other two (below 1:
tensorpar's way is faster), their median and interquartile range.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import unittest.mock

import torch
import torch.distributed as dist

from gpt_step import add_arguments, build_step, launch_and_print


def _quartiles(values) -> list[float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return [round(q1, 3), round(median, 3), round(q3, 3)]


def run(args) -> dict:
    import tensorpar as tp
    from tensorpar import gloo_transport, shared_memory

    tp.initialize_model_parallel(args.tp)
    ways = {"tensorpar": [],
            "all-to-all limit": [unittest.mock.patch.object(gloo_transport, "SHARED_MEMORY_MAX_BYTES", 0)],
            "sockets": [unittest.mock.patch.object(shared_memory, "channel", lambda group: None)]}
    results = {}
    for sp in (False, True):
        args.sp = sp
        step, _ = build_step(args)
        times = {way: [] for way in ways}
        for round_ in range(args.rounds + 1):  # the first round warms up
            order = list(ways)[round_ % len(ways):] + list(ways)[:round_ % len(ways)]
            for way in order:
                with contextlib.ExitStack() as stack:
                    for patch in ways[way]:
                        stack.enter_context(patch)
                    dist.barrier()
                    began = time.perf_counter()
                    for _ in range(args.iters):
                        loss = step()
                    float(loss)
                    took = torch.tensor([(time.perf_counter() - began) / args.iters], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
                if round_:
                    times[way].append(took.item())
        results["tp_sp" if sp else "tp"] = {
            **{f"{way}_ms": round(1e3 * statistics.median(took), 1) for way, took in times.items()},
            **{f"tensorpar_over_{way}_q1_median_q3": _quartiles([ours / theirs for ours, theirs
                                                                 in zip(times["tensorpar"], times[way])])
               for way in ("all-to-all limit", "sockets")}}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, dtype="fp32", sp=False)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=3, help="timed steps per way and round")
    launch_and_print(run, parser.parse_args())


if __name__ == "__main__":
    main()
