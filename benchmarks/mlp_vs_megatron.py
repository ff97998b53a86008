"""MLP block (column, GELU, row) forward+backward at TP=2: compiled and eager tensorpar vs
megatron-core's ``ColumnParallelLinear``/``RowParallelLinear``, in one run::

    python3 -m venv /tmp/mcore_venv
    /tmp/mcore_venv/bin/pip install torch==2.13.0 megatron-core==0.16.1   # CPU torch first
    PYTHONPATH=src /tmp/mcore_venv/bin/python benchmarks/mlp_vs_megatron.py --tp 2

With ``--sp`` both run sequence parallelism (input and output ``[s/TP, b, h]``): megatron-core
allocates its SP all-gather and reduce-scatter buffers on ``torch.cuda.current_device()``, which
this script points at the CPU for the run (nothing else of megatron's is changed). Same shapes and init method,
timed in alternating rounds (the slowest rank's time per round); prints each variant's
median time over megatron's per round: median and interquartile range.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from gpt_step import launch_and_print


def _timed(block, x, iters: int) -> float:
    began = time.perf_counter()
    for _ in range(iters):
        x.grad = None
        block(x).sum().backward()
    return (time.perf_counter() - began) / iters


class _Block(torch.nn.Module):
    def __init__(self, fc, proj) -> None:
        super().__init__()
        self.fc, self.proj = fc, proj

    def forward(self, x):
        return self.proj(torch.nn.functional.gelu(self.fc(x)[0]))[0]


def run(args) -> dict:
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore
    from megatron.core.model_parallel_config import ModelParallelConfig

    import tensorpar as tp

    tp.initialize_model_parallel(args.tp)  # first: it starts the process group megatron's needs
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    h, ffn = args.hidden, 4 * args.hidden
    init = torch.nn.init.xavier_normal_
    if args.sp:
        torch.cuda.current_device = lambda: "cpu"  # megatron's SP buffers: on the CPU of this run
    config = ModelParallelConfig(tensor_model_parallel_size=args.tp, use_cpu_initialization=True,
                                 sequence_parallel=args.sp)
    blocks = {
        "megatron": _Block(mcore.ColumnParallelLinear(h, ffn, config=config, init_method=init, bias=True,
                                                      gather_output=False),
                           mcore.RowParallelLinear(ffn, h, config=config, init_method=init, bias=True,
                                                   input_is_parallel=True, skip_bias_add=False)),
        "tensorpar_eager": _Block(tp.ColumnParallelLinear(h, ffn, init_method=init, sequence_parallel=args.sp),
                                  tp.RowParallelLinear(ffn, h, input_is_parallel=True, init_method=init,
                                                       sequence_parallel=args.sp)),
    }
    blocks["tensorpar_compiled"] = torch.compile(blocks["tensorpar_eager"])
    seq = args.seq // args.tp if args.sp else args.seq
    x = torch.randn(seq, args.batch, h, generator=torch.Generator().manual_seed(0), requires_grad=True)
    results = {}
    for name, block in blocks.items():
        began = time.perf_counter()
        _timed(block, x, args.warmup)
        results[f"{name}_warmup_s"] = round(time.perf_counter() - began, 2)
    times = {name: [] for name in blocks}
    for _ in range(args.rounds):
        for name, block in blocks.items():
            t = torch.tensor(_timed(block, x, args.iters), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
            times[name].append(t.item())
    for name in ("tensorpar_eager", "tensorpar_compiled"):
        ratios = [t / m for t, m in zip(times[name], times["megatron"])]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        results[f"{name}_over_megatron"] = {"q1_median_q3": [round(q1, 3), round(median, 3), round(q3, 3)]}
    results["step_ms_median"] = {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism on both sides")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iters", type=int, default=3)
    launch_and_print(run, parser.parse_args())


if __name__ == "__main__":
    main()
