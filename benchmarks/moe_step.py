"""An MoE layer's training step (forward and backward) at EP 1, 2 and 4 against the same layer
written plainly, side by side in one run::

    python benchmarks/moe_step.py --ranks 2
    python benchmarks/moe_step.py --ranks 4 --tokens 2048

On ``--ranks`` local gloo ranks (one thread each), every rank with its own ``--tokens`` tokens:

- **plain**: the layer as a reader writes it (as transformers' Mixtral): every expert on every
  rank, a loop over the experts, each gathering its tokens with ``index_select`` and adding its
  output back with ``index_add``;
- **EP 1**: :class:`tensorpar.expert_parallel.MoELayer` with every expert on every rank;
- **EP n** (n dividing ``--ranks``, up to it): the same layer with its experts split over n ranks,
  tokens exchanged by all-to-all.

Rounds run the variants in rotated order; reported are each variant's median step time over the
rounds (each round the median of ``--iters`` steps after ``--warmup``) and its time over the plain
layer's. With ``--device cuda`` (one GPU, ``--ranks 1``) the EP 1 layer runs its experts with
``torch._grouped_mm`` (bf16) and ``loop`` is the same layer with the grouped GEMM off.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

VARIANTS = ("plain", "EP 1")


def _plain_moe(moe, x: torch.Tensor) -> torch.Tensor:
    """The layer written plainly, with ``moe``'s weights (its router's choices)."""
    tokens = x.reshape(-1, x.shape[-1])
    scores = F.linear(tokens, moe.router.weight).float().softmax(-1)
    weights, chosen = scores.topk(moe.router.topk, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(tokens.dtype)
    out = torch.zeros_like(tokens)
    for e in range(moe.experts.num_local_experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        gate, up = F.linear(tokens.index_select(0, token), moe.experts.gate_up[e]).chunk(2, dim=-1)
        out = out.index_add(0, token, F.linear(F.silu(gate) * up, moe.experts.down[e]) * weights[token, slot, None])
    return out.view_as(x)


def _layer(args, ep_group, device, dtype):
    from tensorpar.expert_parallel import MoELayer

    torch.manual_seed(0)
    return MoELayer(args.hidden, num_experts=args.experts, ffn_hidden_size=args.ffn, topk=args.topk,
                    ep_group=ep_group, params_dtype=dtype, device=device)


def _median_ms(step, *, warmup: int, iters: int, device) -> float:
    from tensorpar.tensor_parallel.overlap import median_seconds

    for _ in range(warmup):
        step()
    return 1e3 * median_seconds(step, device, iters)


def _rank(args) -> dict:
    import tensorpar as tp

    torch.set_num_threads(1)
    tp.initialize_model_parallel(1, expert_tensor_parallel_size=1)
    try:
        return _measure(args)
    finally:
        tp.destroy_model_parallel()


def _measure(args) -> dict:
    import torch.distributed as dist

    from tensorpar.expert_parallel import experts as grouped

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    world = dist.get_world_size()
    sizes = [n for n in (2, 4, 8) if n <= world and world % n == 0 and args.experts % n == 0]
    groups = {n: [dist.new_group(list(range(first, first + n))) for first in range(0, world, n)]
              [dist.get_rank() // n] for n in sizes}
    layers = {"plain": _layer(args, None, device, dtype), "EP 1": _layer(args, None, device, dtype),
              **{f"EP {n}": _layer(args, group, device, dtype) for n, group in groups.items()}}
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def step_of(name):
        layer = layers[name]

        def step():
            out = _plain_moe(layer, x) if name == "plain" else layer(x)
            out.backward(grad)
        return step

    steps = {name: step_of(name) for name in layers}
    if device.type == "cuda":
        applies = grouped._grouped_mm_applies

        def loop_step():
            grouped._grouped_mm_applies = lambda *a: False
            try:
                steps["EP 1"]()
            finally:
                grouped._grouped_mm_applies = applies
        steps["loop"] = loop_step
    names = list(steps)
    rounds = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            rounds[name].append(_median_ms(steps[name], warmup=args.warmup, iters=args.iters, device=device))
    medians = {name: statistics.median(times) for name, times in rounds.items()}
    return {"median_ms": medians, "over_plain": {n: t / medians["plain"] for n, t in medians.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="each expert's width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    from tensorpar.cli.launch import launch_local

    load = os.getloadavg()[0]
    result = launch_local(_rank, args, nproc=args.ranks)[0]
    print(f"MoE layer step, {args.ranks} rank(s) on {args.device}, {args.tokens} tokens a rank, hidden {args.hidden}, "
          f"{args.experts} experts of width {args.ffn}, top {args.topk}; 1-minute load {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    for name, ms in result["median_ms"].items():
        print(f"{name:>6}: {ms:8.2f} ms, {result['over_plain'][name]:.3f} x plain")
    return result


if __name__ == "__main__":
    main()
