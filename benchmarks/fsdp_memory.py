"""Per-rank memory and step time of a GPT training step: plain DP vs FSDP (ZeRO-3, its default
units: blocks grouped into units of ``--min-unit-mib``) vs FSDP with one unit per block, with and
without ``reshard_after_forward`` (ZeRO-3 and ZeRO-2-like), at TP x DP on local gloo (or NCCL)
ranks.

    python benchmarks/fsdp_memory.py --nproc 4 --tp 2

Per variant and rank: the bytes held between steps, measured from the tensors themselves
(parameters, gradients: ``main_grad`` buckets for plain DP, FSDP's sharded ``.grad``, and
AdamW's state), the peak one step allocates above that (``gpt_step.py``'s measurement), their
sum (the peak), and the median step time. The variants run in turn, round by round, in a rotating order; time ratios are
taken within a round and the median over rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_step import MIB, _step_peak  # noqa: E402  (the same peak measurement)

VARIANTS = ("plain DP", "FSDP", "FSDP a unit per block", "FSDP a unit per block, no reshard")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _variant(name: str, config, tokens, min_unit_mib: float):
    import tensorpar as tp
    from tensorpar.data_parallel.fsdp import ShardedGradSync
    from tensorpar.models import GPT
    from tensorpar.training.loop import adamw

    tp.model_parallel_manual_seed(0)
    model = GPT(config, device=tokens.device)
    dp_group = tp.get_data_parallel_group()
    if name == "plain DP":
        grads = tp.DataParallelGradReducer(model.parameters(), dp_group=dp_group)
    else:
        tp.fully_shard(model, reshard_after_forward=not name.endswith("no reshard"),
                       min_unit_mib=min_unit_mib if name == "FSDP" else 0)
        grads = ShardedGradSync(model)
    optimizer = adamw(model.parameters(), device=tokens.device, lr=1e-4)

    def step():
        grads.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads.finish()
        if config.sequence_parallel:
            tp.allreduce_sequence_parallel_grads(model)
        tp.clip_grad_norm_(model.parameters(), 1.0, dp_group=dp_group)
        optimizer.step()
        return loss

    def held() -> dict:
        params = list(model.parameters())
        gradients = ([b.buffer for b in grads.buckets] if name == "plain DP"
                     else [p.grad for p in params if p.grad is not None])
        state = [v for s in optimizer.state.values() for v in s.values() if v.dim()]
        return {"parameters": _nbytes(params), "gradients": _nbytes(gradients), "optimizer state": _nbytes(state)}

    return step, held


def run(args) -> dict:
    import tensorpar as tp
    from tensorpar.models import GPTConfig

    tp.initialize_model_parallel(args.tp)
    device = tp.parallel_state.default_device()
    config = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, num_layers=args.layers, num_heads=args.heads,
                       hidden_size=args.hidden, sequence_parallel=args.sp)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1 + tp.get_data_parallel_rank())).to(device)
    variants = {name: _variant(name, config, tokens, args.min_unit_mib) for name in VARIANTS}
    losses = {}
    for name, (step, _) in variants.items():
        for _ in range(args.warmup):
            losses[name] = float(step().detach())
    result = {name: {**held(), "peak step": _step_peak(step, device)} for name, (step, held) in variants.items()}
    times = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
            step = variants[name][0]
            dist.barrier()
            spent = []
            for _ in range(args.steps):
                began = time.perf_counter()
                float(step().detach())
                spent.append(time.perf_counter() - began)
            worst = torch.tensor(statistics.median(spent), dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times[name].append(float(worst))
    for name in VARIANTS:
        result[name]["step_s"] = statistics.median(times[name])
        result[name]["step vs plain DP"] = statistics.median(
            t / p for t, p in zip(times[name], times["plain DP"]))
        result[name]["first loss"] = losses[name]
    return result


def main() -> None:
    from tensorpar.data_parallel.fsdp import MIN_UNIT_MIB

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--min-unit-mib", type=float, default=MIN_UNIT_MIB,
                        help="the FSDP row's least unit size (fully_shard's min_unit_mib; 0: a unit per block)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from tensorpar.cli.launch import launch_local

    results = launch_local(run, args, nproc=args.nproc)
    if args.json:
        print(json.dumps({"args": vars(args), "ranks": results}))
        return
    print(f"TP {args.tp} x DP {args.nproc // args.tp}, {args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}, seq {args.seq}, batch {args.batch} per DP rank; MiB on the largest rank")
    print(f"{'variant':34} {'params':>8} {'grads':>8} {'optim':>8} {'sum':>8} {'peak step':>10} {'peak':>8} "
          f"{'step s':>8} {'vs DP':>6}")
    for name in VARIANTS:
        worst = {k: max(results[r][name][k] for r in results)
                 for k in ("parameters", "gradients", "optimizer state", "peak step")}
        held = {r: sum(results[r][name][k] for k in ("parameters", "gradients", "optimizer state")) for r in results}
        total, peak = max(held.values()), max(held[r] + results[r][name]["peak step"] for r in results)
        row = results[0][name]
        print(f"{name:34} {worst['parameters'] / MIB:8.2f} {worst['gradients'] / MIB:8.2f} "
              f"{worst['optimizer state'] / MIB:8.2f} {total / MIB:8.2f} {worst['peak step'] / MIB:10.2f} "
              f"{peak / MIB:8.2f} {row['step_s']:8.3f} {row['step vs plain DP']:6.2f}")


if __name__ == "__main__":
    main()
