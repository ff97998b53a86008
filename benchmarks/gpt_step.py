"""A GPT training step's tokens/s and peak memory per rank: forward, loss, backward, DP grad
reduction, clipping, AdamW (what ``tensorpar train`` runs per step, but AdamW's per-parameter
loop, which runs under any older tree this script is pointed at; ``tensorpar train`` builds the
fused kernel, foreach in the invariant mode), at one TP size.

Run it on two checkouts back to back to measure a change (the cores are shared: same sitting,
same load)::

    PYTHONPATH=OLD/src python benchmarks/gpt_step.py --tp 2 --sp --dtype bf16
    PYTHONPATH=NEW/src python benchmarks/gpt_step.py --tp 2 --sp --dtype bf16

Peak memory is what one step allocates above what is in use before it (model, optimizer state,
buffers): from the profiler's memory events on CPU, from the caching allocator's statistics on
a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 1 << 20


def _step_peak(step, device: torch.device) -> int:
    """Bytes one step allocates above what is in use before it, at its peak.

    GPU: the caching allocator's statistics. CPU: the profiler's memory events (every tensor
    allocation and free, with the running total) over three steps, the smaller of the last two
    steps' peaks above the total each began with. The profiler counts only blocks allocated while
    it runs, so a block from before it that a step frees (FSDP keeps a step's reduce-scatter
    buffers into the next) is not subtracted: the first step's peak would come out too high by it.
    Of the last two, the smaller: gloo's thread drops a collective's tensors when it finishes, at
    a time that varies with the load (once, on a loaded machine, 256 KiB more at the peak of a CP
    rank's step).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return min(_profiled_peaks(step, steps=3)[1:])


def _profiled_peaks(step, *, steps: int) -> list[int]:
    """Per step of ``steps`` run under the profiler: its highest total of allocated bytes minus the total it began with."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for index in range(steps):
            with record_function(f"step {index}"):
                step()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") in {f"step {i}" for i in range(steps)}]
    memory = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                    if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0)
    peaks = []
    for began, ended in sorted(spans):
        during = [(total, size) for ts, total, size in memory if began <= ts <= ended]
        before = [total for ts, total, _ in memory if ts < began]
        start = before[-1] if before else during[0][0] - during[0][1]
        peaks.append(max(total for total, _ in during) - start)
    return peaks


def build_step(args, **config):
    """``(step, model)``: one training step of a freshly seeded GPT that ``args`` describe.

    ``step()`` runs forward, loss, backward, DP grad reduction, SP grad sum, clipping and AdamW
    and returns the loss, with the reductions of the TP-invariant mode (``tensorpar.invariant``)
    when ``config`` has ``tp_invariant=True``, as ``tensorpar train`` does. ``config``: more
    ``GPTConfig`` fields. The model parallel state must be initialised.
    """
    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig

    try:
        from tensorpar.data_parallel import grads
    except ImportError:  # a tree from before the house's folders (even_shapes_vs_before.py --baseline)
        from tensorpar import grads

    device = tp.parallel_state.default_device()
    tp.model_parallel_manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, num_layers=args.layers,
                       num_heads=args.heads, num_query_groups=args.kv_heads, hidden_size=args.hidden,
                       sequence_parallel=args.sp,
                       gradient_accumulation_fusion=args.fusion, recompute=args.recompute, dropout=0.1,
                       **config)
    model = GPT(config, device=device)
    dp_group = tp.get_data_parallel_group()
    # The invariant mode's DP reduction in tensorpar train: each micro-batch into the fixed tree.
    reducer = grads.DataParallelGradReducer(model.parameters(), dp_group=dp_group,
                                            **({"micro_batches": 1} if getattr(config, "tp_invariant", False) else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1 + tp.get_data_parallel_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def step():
        reducer.zero_grad()
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        reducer.finish()
        if config.sequence_parallel:
            grads.allreduce_sequence_parallel_grads(model)
        grads.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        return loss.detach()

    return step, model


def timed(step) -> float:
    """Seconds one ``step()`` takes, its loss read back so that all its work is done."""
    began = time.perf_counter()
    float(step())
    return time.perf_counter() - began


def slowest_rank(times) -> list[float]:
    """Per step, the slowest rank's time (a step takes as long as its slowest rank)."""
    worst = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist()


def add_arguments(parser: argparse.ArgumentParser, *, dtype: str, sp: bool = True) -> None:
    """The model and batch flags :func:`build_step` reads (``--sp`` unless ``sp=False``)."""
    parser.add_argument("--tp", type=int, default=2)
    if sp:
        parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=dtype)
    parser.add_argument("--fusion", action="store_true", help="gradient accumulation fusion")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (grouped-query attention; default: --heads)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)


def add_step_counts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)


def launch_and_print(run, args) -> None:
    """``run(args)`` on ``args.tp`` local ranks; prints rank 0's result as JSON with the arguments
    and the 1-minute load average before and after (the cores are shared)."""
    from tensorpar.cli.launch import launch_local

    load_before = os.getloadavg()[0]
    results = launch_local(run, args, nproc=args.tp)
    print(json.dumps({"args": vars(args), "load_1min": [load_before, os.getloadavg()[0]], **results[0]},
                     indent=1))


def run(args) -> dict:
    import tensorpar as tp

    tp.initialize_model_parallel(args.tp)
    device = tp.parallel_state.default_device()
    step, _ = build_step(args)
    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = _step_peak(step, device)
    median = statistics.median(slowest_rank([timed(step) for _ in range(args.steps)]))
    return {"tokens_per_s": args.batch * args.seq / median, "step_s": median,
            "peak_mib": peak / MIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, dtype="bf16")
    add_step_counts(parser)
    args = parser.parse_args()
    from tensorpar.cli.launch import launch_local

    results = launch_local(run, args, nproc=args.tp)
    print(json.dumps({"args": vars(args), "tokens_per_s": results[0]["tokens_per_s"],
                      "step_s": results[0]["step_s"],
                      "peak_mib_per_rank": [round(results[r]["peak_mib"], 1) for r in sorted(results)]}))


if __name__ == "__main__":
    main()
