"""The comm and memory models' prediction for a Llama-2-70B-shaped GPT at TP 8 x FSDP 64 (512 GPUs),
next to Megatron-LM's distributed optimizer's published bytes per parameter. Pure arithmetic.

    python benchmarks/fsdp_70b_prediction.py [--dp 64] [--tp 8] [--seq 4096] [--micro-batch 1]

Per rank (one GPU) and per training step of one micro-batch: bytes held between steps
(parameters, gradients, optimizer state with any fp32 master copy), the parameters gathered
at the step's peak, and bytes each rank sends over the DP group (FSDP's all-gathers and
reduce-scatters, or the DP all-reduce) and over the TP group (sequence-parallel activations).

Megatron's figures are its docs' table (docs.nvidia.com/megatron-core/developer-guide/latest/
distrib_optimizer.html): bf16 parameters with fp32 gradients take 18 bytes per parameter
replicated, 6 + 12/d with the distributed optimizer, whose step reduce-scatters the fp32
gradients and all-gathers the bf16 parameters over DP.
"""

from __future__ import annotations

import argparse

from tensorpar.distributed.comm import bytes_sent_per_rank
from tensorpar.planning.communication import CommConfig, collectives
from tensorpar.planning.fsdp import DataParallelOp, FSDPConfig, state_bytes_per_rank, step_collectives, units
from tensorpar.models import GPTConfig

GB = 1e9


def llama2_70b(seq_len: int) -> GPTConfig:
    return GPTConfig(vocab_size=32000, max_seq_len=seq_len, num_layers=80, num_heads=64, hidden_size=8192,
                     ffn_hidden_size=28672, num_query_groups=8, norm="rmsnorm", activation="swiglu",
                     position_embedding="rope", bias=False, tie_word_embeddings=False)


def rows(args) -> dict[str, dict[str, float]]:
    config = llama2_70b(args.seq)
    cfg = CommConfig(layer="gpt-step", hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8, seq_len=args.seq,
                     batch=args.micro_batch, vocab=32000, layers=80, tp=args.tp, dtype="bf16", sp=True)
    parts = units(config, tp=args.tp)
    n = sum(u.shard_numel(1) for u in parts)          # parameters of one TP rank
    block_bf16 = 2 * parts[1].shard_numel(1)          # one block's TP shard, gathered in bf16
    root_bf16 = 2 * parts[0].shard_numel(1)
    tp_sent = sum(op.bytes_sent_per_rank for op in collectives(cfg) if op.phase != "grads")
    d = args.dp

    def dp_sent(ops):
        return sum(op.bytes_sent_per_rank for op in ops if isinstance(op, DataParallelOp))

    out = {}
    for name, reshard in (("tensorpar FSDP (ZeRO-3)", True), ("tensorpar FSDP, no reshard (ZeRO-2-like)", False)):
        state = state_bytes_per_rank(config, tp=args.tp, dp=d)
        ops = step_collectives(cfg, config, FSDPConfig(dp=d, reshard_after_forward=reshard))
        # ZeRO-3 holds the root and two blocks (one prefetched) gathered; ZeRO-2-like every block
        # from its forward to its backward.
        gathered = root_bf16 + (2 if reshard else config.num_layers) * block_bf16
        out[name] = dict(parameters=state["parameters"], gradients=state["gradients"], optimizer=state["optimizer"],
                         gathered=gathered, dp_sent=dp_sent(ops), tp_sent=tp_sent)
    plain = state_bytes_per_rank(config, tp=args.tp, dp=d, fsdp=False)
    out["tensorpar plain DP (fp32)"] = dict(**plain, gathered=0, dp_sent=bytes_sent_per_rank("all_reduce", 4 * n, d),
                                            tp_sent=tp_sent)
    out["Megatron, bf16 params + fp32 grads (18 B)"] = dict(
        parameters=2 * n, gradients=4 * n, optimizer=12 * n, gathered=0,
        dp_sent=bytes_sent_per_rank("all_reduce", 4 * n, d), tp_sent=tp_sent)
    out[f"Megatron distributed optimizer (6 + 12/{d} B)"] = dict(
        parameters=2 * n, gradients=4 * n, optimizer=12 * n / d, gathered=0,
        dp_sent=bytes_sent_per_rank("reduce_scatter", 4 * n, d) + bytes_sent_per_rank("all_gather", 2 * n, d),
        tp_sent=tp_sent)
    return {"n": n, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=64)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    args = parser.parse_args()
    table = rows(args)
    n = table.pop("n")
    print(f"Llama-2-70B shape at TP {args.tp} x DP {args.dp} ({args.tp * args.dp} GPUs): {n / 1e9:.3f}B parameters "
          f"per TP rank; GB (1e9) per rank; sent per step of one micro-batch of {args.micro_batch} x {args.seq} "
          "tokens, SP on")
    header = ["variant", "params", "grads", "optim", "held", "B/param", "gathered", "DP sent", "TP sent"]
    print(f"{header[0]:44}" + "".join(f"{h:>9}" for h in header[1:]))
    for name, r in table.items():
        held = r["parameters"] + r["gradients"] + r["optimizer"]
        cells = [r["parameters"] / GB, r["gradients"] / GB, r["optimizer"] / GB, held / GB, held / n,
                 r["gathered"] / GB, r["dp_sent"] / GB, r["tp_sent"] / GB]
        print(f"{name:44}" + "".join(f"{c:9.3f}" for c in cells))


if __name__ == "__main__":
    main()
