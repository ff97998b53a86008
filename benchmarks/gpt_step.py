"""A GPT training step's tokens/s and peak memory per rank: forward, loss, backward, DP grad
reduction, clipping, AdamW (what ``tensorpar train`` runs per step), at one TP size.

Run it on two checkouts back to back to measure a change (the cores are shared: same sitting,
same load)::

    PYTHONPATH=OLD/src python benchmarks/gpt_step.py --tp 2 --sp --dtype bf16
    PYTHONPATH=NEW/src python benchmarks/gpt_step.py --tp 2 --sp --dtype bf16

Peak memory is the resident set's high-water mark (``VmHWM``, reset after the model and the
optimizer exist, so it measures the step: activations, gradients, temporaries) on CPU, and
``torch.cuda.max_memory_allocated`` on a GPU. Linux only on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 1 << 20


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_rss()


def run(args) -> dict:
    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig

    tp.initialize_model_parallel(args.tp)
    device = tp.parallel_state.default_device()
    tp.model_parallel_manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, num_layers=args.layers,
                       num_heads=args.heads, hidden_size=args.hidden, sequence_parallel=args.sp,
                       gradient_accumulation_fusion=args.fusion, dropout=0.1, recompute=args.recompute)
    model = GPT(config, device=device)
    reducer = tp.DataParallelGradReducer(model.parameters(), dp_group=tp.get_data_parallel_group())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def step():
        reducer.zero_grad()
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        reducer.finish()
        if config.sequence_parallel:
            tp.allreduce_sequence_parallel_grads(model)
        tp.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _reset_peak(device)
    times = []
    for _ in range(args.steps):
        began = time.perf_counter()
        loss = step()
        float(loss)  # one read-back per step, so every step's time is complete
        times.append(time.perf_counter() - began)
    worst = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    median = statistics.median(worst.tolist())
    return {"tokens_per_s": args.batch * args.seq / median, "step_s": median,
            "peak_mib": _peak(device) / MIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--fusion", action="store_true", help="gradient accumulation fusion")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    from tensorpar.launch import launch_local

    results = launch_local(run, args, nproc=args.tp)
    print(json.dumps({"args": vars(args), "tokens_per_s": results[0]["tokens_per_s"],
                      "step_s": results[0]["step_s"],
                      "peak_mib_per_rank": [round(results[r]["peak_mib"], 1) for r in sorted(results)]}))


if __name__ == "__main__":
    main()
