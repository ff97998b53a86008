"""Measured memory of pipeline stages and context-parallel ranks against the pre-launch estimate::

    python benchmarks/stage_memory.py [--pp 2 4] [--cp 1 2 4] [--json]

Two parts, each a GPT training step (forward, loss, backward, DP grad reduction, clipping,
AdamW) on local gloo ranks, one thread each, measured after ``--warmup`` steps:

- **PP**: ``PipelinedGPT`` (``tensorpar train --pp``'s module) at each ``--pp`` size under 1F1B
  and GPipe, ``--microbatches`` per step. Per PP rank: the bytes it holds between steps,
  counted from the tensors (parameters, the reducer's gradient buckets, AdamW's state, torch's
  receive buffers), and the peak one step allocates above them (``gpt_step.py``'s
  ``_step_peak``: the profiler's memory events), against
  :func:`tensorpar.pipeline_parallel.pipeline_memory` (held: parameters + gradients + optimizer +
  buffers; step: activations).
- **CP**: one sequence of ``--cp-seq`` tokens at each ``--cp`` size (CP = 1: one rank, the
  plain GPT; above: ``--cp-comm`` a2a and p2p), the step's peak on each rank against the
  estimate's activations (:func:`tensorpar.planning.memory.gpt_training_memory` with ``cp``), and
  the ratio of each layout's largest rank to CP = 1's.

Printed: measured and estimated MiB, their ratio (the issues' target: within 10%), and the
CP ratios (targets: at most 0.55 at CP = 2 and 0.30 at CP = 4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_step import MIB, _step_peak  # noqa: E402  (the same peak measurement)


def _config(args, *, layers: int, seq: int, **fields):
    from tensorpar.models import GPTConfig

    return GPTConfig(vocab_size=args.vocab, max_seq_len=seq, num_layers=layers, num_heads=args.heads,
                     hidden_size=args.hidden, **fields)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _training(model, params, *, grads_group):
    """``(reducer, optimizer, finish)`` of a training step over ``params``."""
    import tensorpar as tp

    reducer = tp.DataParallelGradReducer(params, dp_group=grads_group)
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def finish():
        reducer.finish()
        tp.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return reducer, optimizer, finish


def _pp_rank(args, pp: int, schedule: str) -> dict:
    import tensorpar as tp
    from tensorpar.planning.pipeline import pipeline_memory
    from tensorpar.training.pipeline_step import PipelinedGPT

    tp.initialize_model_parallel(1, pp)
    tp.model_parallel_manual_seed(0)
    config = _config(args, layers=args.layers, seq=args.seq)
    model = PipelinedGPT(config, schedule=schedule, microbatches=args.microbatches, virtual_stages=None,
                         device=torch.device("cpu"))
    params = list(model.parameters())
    reducer, optimizer, finish = _training(model, params, grads_group=tp.get_data_parallel_group())
    rows = torch.randint(0, args.vocab, (args.microbatches, args.batch, args.seq + 1),
                         generator=torch.Generator().manual_seed(1))
    batches = [(r[:, :-1], r[:, 1:]) for r in rows]

    def step():
        reducer.zero_grad()
        model.train_step(batches, reducer=reducer, dtype="fp32")
        finish()

    for _ in range(args.warmup):
        step()
    stages = model.schedule._torch_stages  # torch's receive buffers: activations in, gradients in
    buffers = [info.buffer for stage in stages for infos in stage.args_recv_info.values() for info in infos]
    buffers += [info.buffer for stage in stages for infos in stage.grad_recv_info.values() for info in infos]
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim()]
    held = _nbytes(params) + _nbytes(b.buffer for b in reducer.buckets) + _nbytes(state) + _nbytes(buffers)
    peak = _step_peak(step, torch.device("cpu"))
    rank = tp.get_pipeline_model_parallel_rank()
    estimate = pipeline_memory(config, pp_size=pp, schedule=schedule, microbatches=args.microbatches, tp=1,
                               seq_len=args.seq, micro_batch=args.batch)[rank]
    tp.destroy_model_parallel()
    return {"stages": list(estimate["stages"]), "in_flight": estimate["in_flight"], "held": held, "step": peak,
            "held_estimate": sum(estimate[k] for k in ("parameters", "gradients", "optimizer", "buffers")),
            "step_estimate": estimate["activations"]}


def _cp_rank(args, cp: int, comm_type: str) -> dict:
    import tensorpar as tp
    from tensorpar.planning.memory import gpt_training_memory
    from tensorpar.models import GPT

    tp.initialize_model_parallel(1, context_parallel_size=cp)
    tp.model_parallel_manual_seed(0)
    config = _config(args, layers=args.cp_layers, seq=args.cp_seq, context_parallel_comm=comm_type)
    model = GPT(config, cp_group=tp.get_context_parallel_group() if cp > 1 else None)
    params = list(model.parameters())
    reducer, _, finish = _training(model, params, grads_group=tp.get_data_parallel_group(with_context_parallel=True))
    tokens = torch.randint(0, args.vocab, (1, args.cp_seq + 1), generator=torch.Generator().manual_seed(1))

    def step():
        reducer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        finish()

    for _ in range(args.warmup):
        step()
    peak = _step_peak(step, torch.device("cpu"))
    estimate = gpt_training_memory(config, tp=1, cp=cp, seq_len=args.cp_seq, micro_batch=1)
    tp.destroy_model_parallel()
    return {"step": peak, "step_estimate": estimate["activations"]}


def _run(part: str, args, size: int, variant: str) -> dict:
    """One layout on ``size`` local ranks: ``{rank: result}``."""
    from tensorpar.cli.launch import launch_local

    entry = _pp_rank if part == "pp" else _cp_rank
    return launch_local(entry, args, size, variant, nproc=size)


def _ratio(measured: float, estimate: float) -> str:
    return f"{measured / estimate:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--cp-comm", nargs="+", default=["a2a", "p2p"])
    parser.add_argument("--cp-seq", type=int, default=4096)
    parser.add_argument("--cp-layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    report = {"pp": {}, "cp": {}}
    for pp in args.pp:
        for schedule in args.schedules:
            report["pp"][f"PP={pp} {schedule}"] = _run("pp", args, pp, schedule)
    for cp in args.cp:
        for comm_type in (args.cp_comm if cp > 1 else ["-"]):
            report["cp"][f"CP={cp} {comm_type}"] = _run("cp", args, cp, comm_type if cp > 1 else "p2p")
    if args.json:
        print(json.dumps({"args": vars(args), "load_1min": [load_before, os.getloadavg()[0]], **report}))
        return
    print(f"PP: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
          f"micro-batch {args.batch}, {args.microbatches} micro-batches, fp32; MiB per PP rank")
    print(f"{'layout':16} {'rank':>4} {'stage':>5} {'in flight':>9} {'held':>7} {'est.':>7} {'ratio':>6} "
          f"{'step':>7} {'est.':>7} {'ratio':>6}")
    for name, ranks in report["pp"].items():
        for rank, r in sorted(ranks.items()):
            print(f"{name:16} {rank:4} {','.join(map(str, r['stages'])):>5} "
                  f"{','.join(map(str, r['in_flight'].values())):>9} {r['held'] / MIB:7.2f} "
                  f"{r['held_estimate'] / MIB:7.2f} {_ratio(r['held'], r['held_estimate']):>6} "
                  f"{r['step'] / MIB:7.2f} {r['step_estimate'] / MIB:7.2f} {_ratio(r['step'], r['step_estimate']):>6}")
    print(f"\nCP: one sequence of {args.cp_seq} tokens, {args.cp_layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads, vocab {args.vocab}, fp32; MiB on the largest rank")
    print(f"{'layout':10} {'step':>8} {'est.':>8} {'ratio':>6} {'vs CP=1':>8} {'est. vs CP=1':>12}")
    base = report["cp"].get("CP=1 -")
    base = max(base.values(), key=lambda r: r["step"]) if base else None
    for name, ranks in report["cp"].items():
        r = max(ranks.values(), key=lambda r: r["step"])
        versus = f"{r['step'] / base['step']:8.3f} {r['step_estimate'] / base['step_estimate']:12.3f}" if base else ""
        print(f"{name:10} {r['step'] / MIB:8.2f} {r['step_estimate'] / MIB:8.2f} "
              f"{_ratio(r['step'], r['step_estimate']):>6} {versus}")
    print(f"\n1-minute load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
