"""Ring attention's compute/communication overlap, measured, against the model's prediction::

    python benchmarks/ring_overlap.py [--cp 2] [--seq-len 512] [--batch 4] [--heads 4]
                                      [--kv-heads 4] [--head-dim 64] [--rounds 5] [--json]

On ``--cp`` local gloo ranks (one thread each) every rank holds its two chunks of one sequence
of ``--seq-len`` tokens: q ``[batch, heads, 2L, head-dim]``, k and v ``[batch, kv-heads, 2L,
head-dim]`` (fp32). Three variants, each timed per iteration as forward (``ring_attention``)
and backward (``torch.autograd.grad`` of the output, timed on its own right after the forward
of the same iteration: every iteration builds a fresh graph):

- **ring**: :func:`tensorpar.context_parallel.ring_attention` as it is;
- **compute only**: the same call with the ring's ``_pass_on`` replaced, in this script only,
  by a finished :class:`tensorpar.distributed.comm.Handle` holding a copy of what it would have sent: each
  rank attends to its own K/V in every step, the same blocks as the ring (which chunk pairs are
  visible depends on the rank and step alone), with nothing travelling;
- **communication only**: the ring's transfers with no attention, each waited before the next
  is issued: forward ``CP - 1`` K/V passes ``[2, b, G, 2L, d]``, backward ``CP - 1`` K/V passes
  and ``CP`` fp32 dK/dV passes ``[2, b, G, 1, 2L, d]`` in the ring's order.

Each round runs the three in turn, the order rotating from round to round: ``--warmup``
untimed iterations, then ``--iters`` iterations each after a barrier. An iteration's time is
the slowest rank's; a round's figure is the median over its iterations, and the reported figure
the median over rounds. Measured per phase: **exposed** = ring - compute only (the median of
the per-round differences, so the machine's slow drift cancels), **hidden** = 1 - exposed /
communication only, clamped to 0-100%.

Predicted: :func:`tensorpar.planning.context.ring_overlap` for a ``CommConfig`` of the same shapes
(TP 1, fp32) on a ``LinkModel`` measured in the same run: latency from a one-element
``send_recv``, bytes per second from the K/V-sized one (each the slowest rank's median, every
call after a barrier as in the variants), and the FLOP rate fitted so that the
model's forward compute equals the measured compute-only forward. So what is compared is the
model's structure (which transfers hide behind which steps, backward's compute as a multiple of
forward's), not a FLOP-rate guess. It is printed twice: with ``overlap`` 1 (every transfer as
long as the attention beside it hidden) and with ``overlap`` from
:func:`tensorpar.tensor_parallel.overlap.measure_link` on the CP group (an all-reduce beside a GEMM of one
chunk pair's scores). The 1-minute load average before and after is printed with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

VARIANTS = ("ring", "compute only", "communication only")
PHASES = ("forward", "backward")
QUANTITIES = ("ring", "communication", "compute", "exposed", "hidden")


@contextlib.contextmanager
def _no_travel():
    """Every pass of the ring (K/V, dK/dV) a finished handle holding a copy of the tensor."""
    from tensorpar.distributed import comm
    from tensorpar.context_parallel import ring

    travelling = ring._pass_on
    ring._pass_on = lambda tensor, group, tag: comm.Handle(None, tensor.clone())
    try:
        yield
    finally:
        ring._pass_on = travelling


def _variants(args, group) -> tuple[dict, torch.Tensor]:
    """``({variant: one iteration}, this rank's K/V)``; an iteration returns its (forward,
    backward) seconds."""
    from tensorpar.context_parallel import ring, ring_attention

    local = args.seq_len // args.cp
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=generator).requires_grad_(grad)

    q = randn(args.batch, args.heads, local, args.head_dim, grad=True)
    k, v = (randn(args.batch, args.kv_heads, local, args.head_dim, grad=True) for _ in range(2))
    grad_out = randn(*q.shape)
    kv = torch.stack([k.detach(), v.detach()])
    grad_kv = torch.zeros(kv.unsqueeze(3).shape, dtype=torch.float32)

    def attention():
        start = time.perf_counter()
        out = ring_attention(q, k, v, cp_group=group)
        middle = time.perf_counter()
        torch.autograd.grad(out, (q, k, v), grad_out)
        return middle - start, time.perf_counter() - middle

    def compute_only():
        with _no_travel():
            return attention()

    def communication_only():
        start = time.perf_counter()
        for _ in range(args.cp - 1):
            ring._pass_on(kv, group, ring._KV_TAG).wait()
        middle = time.perf_counter()
        for step in range(args.cp):
            if step < args.cp - 1:
                ring._pass_on(kv, group, ring._KV_TAG).wait()
            ring._pass_on(grad_kv, group, ring._GRAD_TAG).wait()
        return middle - start, time.perf_counter() - middle

    return {"ring": attention, "compute only": compute_only, "communication only": communication_only}, kv


def _seconds(fn, group, reps: int) -> float:
    """This rank's median seconds of ``fn()``, each call after a barrier (as the variants are)."""
    fn()
    times = []
    for _ in range(reps):
        torch.distributed.barrier(group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _link(args, group, kv: torch.Tensor) -> dict:
    """The link this machine gives the ring: worst-rank seconds of a one-element and of a K/V
    ``send_recv``, and ``measure_link``'s overlap on the CP group."""
    from tensorpar.distributed import comm
    from tensorpar.context_parallel import ring
    from tensorpar.tensor_parallel.overlap import measure_link

    tiny = torch.zeros(1)
    latency_s = _seconds(lambda: ring._pass_on(tiny, group, ring._KV_TAG).wait(), group, 4 * args.iters)
    kv_s = _seconds(lambda: ring._pass_on(kv, group, ring._KV_TAG).wait(), group, 2 * args.iters)
    chunk = args.seq_len // (2 * args.cp)
    overlap = measure_link(group, device=torch.device("cpu"), dtype=torch.float32,
                           rows=args.batch * args.heads * chunk, gemm=(args.head_dim, chunk),
                           comm_elements=kv.numel())["overlap"]
    latency_s, kv_s = comm.all_reduce(comm.scalars([latency_s, kv_s], group, dtype=torch.float64), group,
                                      op="max").tolist()
    kv_bytes = kv.numel() * kv.element_size()
    return dict(latency_s=latency_s, kv_s=kv_s, kv_bytes=kv_bytes,
                bytes_per_s=kv_bytes / max(kv_s - latency_s, 1e-9), overlap=overlap)


def _rank(args) -> dict:
    """One CP rank: the link, then ``--rounds`` rounds of every variant (worst-rank seconds)."""
    import tensorpar as tp
    from tensorpar.distributed import comm

    torch.set_num_threads(1)
    tp.initialize_model_parallel(1, context_parallel_size=args.cp)
    group = tp.get_context_parallel_group()
    try:
        variants, kv = _variants(args, group)
        link = _link(args, group, kv)
        rounds = []
        for round_ in range(args.rounds):
            shift = round_ % len(VARIANTS)
            seconds = {}
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                for _ in range(args.warmup):
                    variants[name]()
                seconds[name] = []
                for _ in range(args.iters):
                    torch.distributed.barrier(group)
                    seconds[name].append(variants[name]())
            times = comm.scalars([seconds[name] for name in VARIANTS], group, dtype=torch.float64)
            worst = comm.all_reduce(times, group, op="max")  # [variant, iteration, phase]
            rounds.append({name: {phase: statistics.median(worst[i, :, p].tolist()) for p, phase in enumerate(PHASES)}
                           for i, name in enumerate(VARIANTS)})
    finally:
        tp.destroy_model_parallel()
    return {"link": link, "rounds": rounds}


def _hidden(exposed_s: float, communication_s: float) -> float:
    return min(1.0, max(0.0, 1 - exposed_s / communication_s)) if communication_s > 0 else 1.0


def _measured(rounds: list[dict]) -> dict:
    def median(fn):
        return statistics.median(fn(r) for r in rounds)

    out = {}
    for phase in PHASES:
        row = {"ring": median(lambda r: r["ring"][phase]),
               "communication": median(lambda r: r["communication only"][phase]),
               "compute": median(lambda r: r["compute only"][phase]),
               "exposed": median(lambda r: r["ring"][phase] - r["compute only"][phase])}
        out[phase] = {**row, "hidden": _hidden(row["exposed"], row["communication"])}
    return out


def _predicted(args, link: dict, compute_forward_s: float) -> tuple[float, dict]:
    """``(flops_per_s, {"overlap 1" | "overlap measured": {phase: figures}})``: the model at
    overlap 1 and at ``link``'s."""
    from tensorpar.planning.communication import CommConfig, LinkModel
    from tensorpar.planning.context import ContextConfig, ring_overlap

    cfg = CommConfig(layer="gpt-step", hidden=args.heads * args.head_dim, heads=args.heads, kv_heads=args.kv_heads,
                     seq_len=args.seq_len, batch=args.batch, layers=1, tp=1, dtype="fp32")
    context = ContextConfig(cp=args.cp, comm_type="p2p")

    def model(flops_per_s: float, overlap: float) -> list[dict]:
        return ring_overlap(cfg, context, LinkModel(link["latency_s"], link["bytes_per_s"], flops_per_s, overlap))

    forward_flops = model(1.0, 1.0)[0]["compute_s"]  # at one FLOP per second: the forward's FLOPs
    flops_per_s = forward_flops / compute_forward_s
    predictions = {}
    for name, overlap in (("overlap 1", 1.0), ("overlap measured", link["overlap"])):
        rows = {r["phase"]: r for r in model(flops_per_s, overlap)}
        predictions[name] = {
            phase: {"ring": rows[phase]["compute_s"] + rows[phase]["exposed_s"],
                    "communication": rows[phase]["communication_s"], "compute": rows[phase]["compute_s"],
                    "exposed": rows[phase]["exposed_s"],
                    "hidden": _hidden(rows[phase]["exposed_s"], rows[phase]["communication_s"])}
            for phase in PHASES}
    return flops_per_s, predictions


def _cell(quantity: str, value: float) -> str:
    return f"{100 * value:.0f}%" if quantity == "hidden" else f"{1e3 * value:.2f} ms"


def _report(args, result: dict, load: list[float]) -> list[str]:
    link, measured = result["link"], result["measured"]
    columns = ["measured", "model (overlap 1)", f"model (overlap {link['overlap']:.2f})"]
    lines = [f"ring attention at CP {args.cp}: a sequence of {args.seq_len} tokens ({args.seq_len // (2 * args.cp)} "
             f"per chunk, 2 chunks per rank), batch {args.batch}, {args.heads} heads / {args.kv_heads} KV heads of "
             f"{args.head_dim}, fp32, one thread per rank; worst rank, median of {args.rounds} rounds x {args.iters} "
             "iterations",
             f"link: latency {1e3 * link['latency_s']:.3f} ms, {link['bytes_per_s'] / 1e9:.3f} GB/s (K/V send_recv of "
             f"{link['kv_bytes'] / 2**20:.2f} MiB: {1e3 * link['kv_s']:.2f} ms), measure_link overlap "
             f"{link['overlap']:.2f}; model FLOP rate fitted to the compute-only forward: "
             f"{result['flops_per_s'] / 1e9:.2f} GFLOP/s", "",
             f"{'phase':9} {'quantity':14} " + " ".join(f"{c:>20}" for c in columns)]
    for phase in PHASES:
        for quantity in QUANTITIES:
            cells = [measured[phase][quantity], *(p[phase][quantity] for p in result["predicted"].values())]
            lines.append(f"{phase:9} {quantity:14} " + " ".join(f"{_cell(quantity, c):>20}" for c in cells))
    return lines + ["", f"1-minute load {load[0]:.1f} before, {load[1]:.1f} after"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.cp < 2 or args.seq_len % (2 * args.cp) or args.heads % args.kv_heads or min(
            args.batch, args.kv_heads, args.head_dim, args.rounds, args.iters) < 1 or args.warmup < 0:
        parser.error("need --cp >= 2, --seq-len a multiple of 2 x CP, --kv-heads dividing --heads, and positive sizes")
    from tensorpar.cli.launch import launch_local

    load_before = os.getloadavg()[0]
    result = launch_local(_rank, args, nproc=args.cp)[0]
    load = [load_before, os.getloadavg()[0]]
    result["measured"] = _measured(result["rounds"])
    result["flops_per_s"], result["predicted"] = _predicted(args, result["link"],
                                                            result["measured"]["forward"]["compute"])
    if args.json:
        print(json.dumps({"args": vars(args), "load_1min": load, **result}))
        return
    print("\n".join(_report(args, result, load)))


if __name__ == "__main__":
    main()
