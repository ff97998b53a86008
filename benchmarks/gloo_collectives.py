"""tensorpar's collectives on gloo (CPU tensors) against gloo's own, per op and size, in one run::

    python benchmarks/gloo_collectives.py --ranks 2

On gloo, ``tensorpar.comm`` sends a CPU tensor's reduce-scatter, its all-gather while the
all-to-all's copies of it come to ``comm.EXCHANGE_MAX_BYTES`` at most, and its all-reduce over 2
ranks under the same limit, as one exchange, combines the blocks in rank order, and waits by
polling. Between the ranks of one host the exchange goes through shared memory
(``tensorpar.shared_memory``; then all-gathers and all-reduces of any number of ranks up to
``gloo_transport.SHARED_MEMORY_MAX_BYTES`` too), elsewhere as gloo's all-to-all
(``gloo_transport.YieldingWait`` polls it). Per op and size, in alternating rounds:
``comm``'s call as it runs ("tensorpar"), the same with shared memory off ("all-to-all"), and
with the exchange and the polling off ("gloo": gloo's ``all_reduce``, ``all_gather_single``,
``reduce_scatter_single`` and their waits). The ratios are tensorpar's time over gloo's and over
the all-to-all's (below 1: tensorpar's is faster), the median over the rounds with its
interquartile range, the slowest rank's time per round. Sizes are the tensor's
bytes: an all-gather's input, a reduce-scatter's input, an all-reduce's tensor. With
``--gemm N`` every rank multiplies two N x N matrices before each call, as a training step
computes between its collectives (only the calls are timed): where waiting by polling counts.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import unittest.mock

import torch
import torch.distributed as dist

from gpt_step import launch_and_print

KIB = 1024


def _quartiles(values) -> list[float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return [round(q1, 3), round(median, 3), round(q3, 3)]


def run(args) -> dict:
    import tensorpar as tp
    from tensorpar import comm, gloo_transport, shared_memory

    tp.initialize_model_parallel(args.ranks)
    group = tp.get_tensor_model_parallel_group()
    n = comm.group_size(group)
    gloo_own = [unittest.mock.patch.object(comm, "_exchanged", lambda *a, **k: False),
                unittest.mock.patch.object(comm, "_through_shared_memory", lambda *a, **k: False),
                unittest.mock.patch.object(gloo_transport, "POLL_SECONDS", 0.0)]
    all_to_all = [unittest.mock.patch.object(shared_memory, "channel", lambda group: None)]
    operands = [torch.randn(args.gemm, args.gemm) for _ in range(2)]
    results = {}
    for kib in args.sizes_kib:
        tensor = torch.zeros(kib * KIB // 4 // n * n)  # zeros: the all-reduce sums it into itself
        calls = {"all_reduce": lambda: comm.all_reduce(tensor, group),
                 "all_gather": lambda: comm.all_gather(tensor, group),
                 "reduce_scatter": lambda: comm.reduce_scatter(tensor, group)}
        repeats = max(2, args.repeats * 256 // max(kib, 256))
        for op, call in calls.items():
            times = {"tensorpar": [], "all-to-all": [], "gloo": []}
            for _ in range(args.rounds):
                for side, patches in (("tensorpar", []), ("all-to-all", all_to_all), ("gloo", gloo_own)):
                    with contextlib.ExitStack() as stack:
                        for patch in patches:
                            stack.enter_context(patch)
                        call()
                        dist.barrier(group=group)
                        spent = 0.0
                        for _ in range(repeats):
                            torch.mm(*operands)
                            began = time.perf_counter()
                            call()
                            spent += time.perf_counter() - began
                        took = torch.tensor([spent / repeats], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
                    times[side].append(took.item())
            results[f"{op} {kib} KiB"] = {
                **{f"{side}_ms": round(1e3 * statistics.median(took), 3) for side, took in times.items()},
                **{f"over_{side}_q1_median_q3": _quartiles([ours / theirs for ours, theirs
                                                            in zip(times["tensorpar"], times[side])])
                   for side in ("gloo", "all-to-all")}}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[2, 256, 1024, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20, help="calls timed per round at 256 KiB and below")
    parser.add_argument("--gemm", type=int, default=0, help="an N x N GEMM on every rank before each call")
    args = parser.parse_args()
    args.tp = args.ranks  # launch_and_print starts args.tp ranks
    launch_and_print(run, args)


if __name__ == "__main__":
    main()
