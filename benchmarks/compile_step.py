"""Compiled vs eager GPT training step (forward, loss, backward, AdamW) at one TP size, with and
without sequence parallelism, in one run::

    python benchmarks/compile_step.py --tp 2

Per variant: ``torch.compile(model)`` (inductor) against the same model eager, timed in
alternating rounds so both meet the same load; the ratio is compiled time / eager time (below 1:
compiled is faster). The 1-minute load average before and after is printed with the figures:
on shared cores a ratio is only as good as the load was steady. Dropout is 0 (dropout's
TP-invariant masks break the graph).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def _timed(step, iters: int) -> float:
    began = time.perf_counter()
    for _ in range(iters):
        loss = step()
    float(loss.detach())  # every step's work is done
    return (time.perf_counter() - began) / iters


def run(args) -> dict:
    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig

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
                               num_heads=args.heads, hidden_size=args.hidden, sequence_parallel=sp)
            model = GPT(config, device=device)
            forward = torch.compile(model) if mode == "compiled" else model
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

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
        ratios, times = [], {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for mode in ("eager", "compiled"):
                t = torch.tensor(_timed(steps[mode], args.iters), dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
                times[mode].append(t.item())
            ratios.append(times["compiled"][-1] / times["eager"][-1])
        name = "tp_sp" if sp else "tp"
        results[name] = {"eager_step_ms": 1e3 * statistics.median(times["eager"]),
                         "compiled_step_ms": 1e3 * statistics.median(times["compiled"]),
                         "compiled_over_eager": statistics.median(ratios),
                         "ratio_per_round": [round(r, 3) for r in ratios]}
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
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    from tensorpar.tools.launch import launch_local

    load_before = os.getloadavg()[0]
    results = launch_local(run, args, nproc=args.tp)
    print(json.dumps({"args": vars(args), "load_1min": [load_before, os.getloadavg()[0]], **results[0]},
                     indent=1))


if __name__ == "__main__":
    main()
