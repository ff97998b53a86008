"""The TP-invariant mode's cost: a GPT training step with ``tp_invariant=True`` against the
default mode, in one run at one TP size (step-time ratio, and each mode's CommLedger bytes).

The two models are timed in alternating rounds, so both see the same load on shared cores::

    python benchmarks/tp_invariant.py --tp 2 [--sp] [--dtype fp32|bf16] [--attention-dropout 0.1]

With ``--attention-dropout P`` both modes drop attention probabilities (the default mode inside
SDPA, the invariant mode with its per-head masks and explicit attention), and the invariant mode
also runs without attention dropout: ``attention_dropout_cost`` is the ratio of the two.

One step = forward, vocab-parallel loss, backward, DP grad reduction, SP grads, clipping,
AdamW (what ``tensorpar train`` runs). Bytes are what each rank sends under ring algorithms
(``CommRecord.bytes_sent_per_rank``), per op, for one step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist


def _stepper(invariant_mode: bool, args, attention_dropout: float):
    import tensorpar as tp
    from tensorpar import grads as tp_grads
    from tensorpar import invariant
    from tensorpar.models import GPT, GPTConfig

    device = tp.parallel_state.default_device()
    tp.model_parallel_manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, num_layers=args.layers, num_heads=args.heads,
                       hidden_size=args.hidden, sequence_parallel=args.sp, dropout=0.1, attention_dropout=attention_dropout,
                       tp_invariant=invariant_mode)
    model = GPT(config, device=device)
    grads = invariant if invariant_mode else tp_grads
    reducer = grads.DataParallelGradReducer(model.parameters(), dp_group=tp.get_data_parallel_group())
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
        grads.allreduce_sequence_parallel_grads(model)
        grads.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        return float(loss.detach())  # one read-back per step, so every step's time is complete

    return step


def run(args) -> dict:
    import tensorpar as tp

    tp.initialize_model_parallel(args.tp)
    steps = {"default": _stepper(False, args, args.attention_dropout),
             "tp_invariant": _stepper(True, args, args.attention_dropout)}
    if args.attention_dropout:
        steps["tp_invariant_no_attention_dropout"] = _stepper(True, args, 0.0)
    sent = {}
    for name, step in steps.items():
        for _ in range(args.warmup):
            step()
        with tp.CommLedger() as ledger:
            step()
        per_op = defaultdict(float)
        for record in ledger.records:
            per_op[record.op] += record.bytes_sent_per_rank
        sent[name] = {"total": sum(per_op.values()), "collectives": len(ledger.records), **per_op}
    times = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            began = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - began)
    result = {}
    for name, values in times.items():
        worst = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        result[name] = statistics.median(worst.tolist())
    return {"step_s": result, "bytes_sent_per_rank": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    args = parser.parse_args()
    from tensorpar.tools.launch import launch_local

    out = launch_local(run, args, nproc=args.tp)[0]
    step_s, sent = out["step_s"], out["bytes_sent_per_rank"]
    costs = {}
    if args.attention_dropout:
        costs["attention_dropout_cost"] = step_s["tp_invariant"] / step_s["tp_invariant_no_attention_dropout"]
    print(json.dumps({"args": vars(args), "step_s": step_s,
                      "step_time_ratio": step_s["tp_invariant"] / step_s["default"], **costs,
                      "bytes_sent_per_rank": sent,
                      "bytes_ratio": sent["tp_invariant"]["total"] / max(sent["default"]["total"], 1)}))


if __name__ == "__main__":
    main()
