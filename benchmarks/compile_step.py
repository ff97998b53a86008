"""Compiled vs eager GPT training step (forward, loss, backward, AdamW) at one TP size, with and
without sequence parallelism, in one run::

    python benchmarks/compile_step.py --tp 2

Per variant: ``torch.compile(model)`` (inductor) against the same model eager, timed in
alternating rounds (which goes first alternates too) so both meet the same load; the ratio is
compiled time / eager time (below 1: compiled is faster): the median ratio over the rounds and
its interquartile range, the compile warm-up excluded; the same for the CPU time the ranks spend
(less sensitive to other processes on shared cores than wall time). Dynamo's graph-break count
and the graphs compiled during the timed rounds (recompiles; 0 expected) are printed too. The
1-minute load average before and after is printed with the figures: on shared cores a ratio is
only as good as the load was steady.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from gpt_step import launch_and_print


def _timed(step, iters: int) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) per step."""
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        loss = step()
    float(loss.detach())  # every step's work is done
    return (time.perf_counter() - began) / iters, (time.process_time() - cpu) / iters


def _quartiles(values) -> list[float]:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return [round(q1, 3), round(median, 3), round(q3, 3)]


def _graphs() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def run(args) -> dict:
    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig
    from tensorpar.training.loop import adamw

    tp.initialize_model_parallel(args.tp)
    device = tp.parallel_state.default_device()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    results = {}
    for sp in (False, True):
        steps = {}
        for mode in ("eager", "compiled"):
            tp.model_parallel_manual_seed(0)
            config = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, num_layers=args.layers,
                               num_heads=args.heads, hidden_size=args.hidden, sequence_parallel=sp,
                               dropout=args.dropout)
            model = GPT(config, device=device)
            forward = torch.compile(model) if mode == "compiled" else model
            optimizer = adamw(model.parameters(), device=device, lr=1e-4)

            def step(model=model, forward=forward, optimizer=optimizer, sp=sp):
                optimizer.zero_grad(set_to_none=True)
                with autocast:
                    loss = forward(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                if sp:
                    tp.allreduce_sequence_parallel_grads(model)
                optimizer.step()
                return loss

            began = time.perf_counter()
            _timed(step, args.warmup)
            steps[mode] = step
            results[f"{'sp' if sp else 'tp'}_{mode}_warmup_s"] = time.perf_counter() - began
        graphs_before, _ = _graphs()
        ratios, cpu_ratios, times = [], [], {"eager": [], "compiled": []}
        for round_ in range(args.rounds):
            cpu = {}
            for mode in ("eager", "compiled")[::1 if round_ % 2 == 0 else -1]:
                t = torch.tensor(_timed(steps[mode], args.iters), dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
                times[mode].append(t[0].item())
                cpu[mode] = t[1].item()
            ratios.append(times["compiled"][-1] / times["eager"][-1])
            cpu_ratios.append(cpu["compiled"] / cpu["eager"])
        graphs, breaks = _graphs()
        name = "tp_sp" if sp else "tp"
        results[name] = {"eager_step_ms": 1e3 * statistics.median(times["eager"]),
                         "compiled_step_ms": 1e3 * statistics.median(times["compiled"]),
                         "compiled_over_eager": statistics.median(ratios),
                         "ratio_q1_median_q3": _quartiles(ratios),
                         "ratio_per_round": [round(r, 3) for r in ratios],
                         "cpu_time_ratio_q1_median_q3": _quartiles(cpu_ratios),
                         "graph_breaks": breaks, "graphs_compiled_while_timed": graphs - graphs_before}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iters", type=int, default=3)
    launch_and_print(run, parser.parse_args())


if __name__ == "__main__":
    main()
