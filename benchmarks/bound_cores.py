"""Ranks bound to their own cores against unbound, in one run: the GPT training step at one TP
size, eager and compiled, with or without SP::

    python benchmarks/bound_cores.py --tp 2 [--sp]

``tensorpar.tools.launch`` binds each rank of a multi-process CPU run, and every thread it
starts, to its share of the cores (``TENSORPAR_PIN_CORES=0``: not). Here every round times the
step both ways, rebinding every thread of each rank in between (which goes first alternates), so
both meet the same load; the ratio is bound time / unbound time (below 1: binding is faster),
the median over the rounds and its interquartile range, per mode. The same for a 512 KiB swap
(``gloo_transport.start_swap``, at TP 2) after an N x N GEMM on every rank (``--gemm``), the
communication a TP=2 step waits on: its median and 90th percentile, bound and unbound.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from compile_step import _quartiles
from gpt_step import add_arguments, build_step, launch_and_print, slowest_rank, timed
from tensorpar.tools.launch import PIN_CORES_ENV, bind_threads, binds_cores, core_share, physical_cores


def _swap_latencies(group, gemm: int, count: int) -> list[float]:
    from tensorpar.gloo_transport import start_swap

    sent, received = torch.randn(128 << 10), torch.empty(128 << 10)
    a = torch.randn(gemm, gemm)
    times = []
    for _ in range(count):
        a @ a
        began = time.perf_counter()
        start_swap(sent, received, group).wait()
        times.append(time.perf_counter() - began)
    return times


def run(args) -> dict:
    import tensorpar as tp

    tp.initialize_model_parallel(args.tp)
    bound, unbound = os.sched_getaffinity(0), os.sched_getaffinity(os.getppid())  # the launcher's
    steps = {}
    for mode in ("eager", "compiled"):
        step, model = build_step(args)
        if mode == "compiled":
            model.compile()
        for _ in range(args.warmup):
            step()
        steps[mode] = step
    group = tp.get_tensor_model_parallel_group()
    times = {(mode, binding): [] for mode in (*steps, "swap") for binding in ("bound", "unbound")}
    for round_ in range(args.rounds):
        for binding in ("bound", "unbound")[::1 if round_ % 2 == 0 else -1]:
            bind_threads(bound if binding == "bound" else unbound)
            for mode, step in steps.items():
                dist.barrier()
                times[mode, binding].append(statistics.median(slowest_rank([timed(step) for _ in range(args.iters)])))
            if args.tp == 2:
                times["swap", binding] += _swap_latencies(group, args.gemm, 20)
    bind_threads(bound)
    results = {}
    for mode in steps:
        ratios = [b / u for b, u in zip(times[mode, "bound"], times[mode, "unbound"])]
        results[mode] = {"bound_step_ms": 1e3 * statistics.median(times[mode, "bound"]),
                         "unbound_step_ms": 1e3 * statistics.median(times[mode, "unbound"]),
                         "bound_over_unbound": statistics.median(ratios), "ratio_q1_median_q3": _quartiles(ratios)}
    results["compiled_over_eager"] = {
        binding: statistics.median([c / e for c, e in zip(times["compiled", binding], times["eager", binding])])
        for binding in ("bound", "unbound")}
    if args.tp == 2:
        results["swap_512kib_ms_median_p90"] = {
            binding: [round(1e3 * statistics.median(times["swap", binding]), 3),
                      round(1e3 * statistics.quantiles(times["swap", binding], n=10)[-1], 3)]
            for binding in ("bound", "unbound")}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, dtype="fp32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--gemm", type=int, default=300, help="the GEMM before each timed swap")
    parser.set_defaults(layers=2, seq=128, vocab=4096)
    args = parser.parse_args()
    if not binds_cores() or core_share(physical_cores(os.sched_getaffinity(0)), 0, args.tp) is None:
        parser.error(f"--tp {args.tp}: its ranks are not bound to cores here (fewer cores than ranks, not Linux, "
                     f"a GPU, OMP_NUM_THREADS set or {PIN_CORES_ENV}=0), so there is nothing to compare")
    launch_and_print(run, args)


if __name__ == "__main__":
    main()
