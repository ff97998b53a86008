"""``tensorpar bench``: an MLP block (column -> GELU -> row), tensorpar against PyTorch DTensor TP,
and a GPT training step's TP=1 -> TP scaling.

Every MLP variant runs forward + backward (+ zeroing grads) of the same block on the same data,
in one run, on gloo/CPU with one thread per rank:

* ``unsharded``: plain ``nn.Linear -> GELU -> nn.Linear`` in one process (rank 0; the other
  ranks wait at a barrier), the baseline of the scaling efficiency ``T1 / (TP x T_TP)``;
* ``compute_only``: every rank runs its shard's layers concurrently with no communication (wrong
  result, right cost): the efficiency ceiling of any TP implementation on this machine;
* ``tensorpar`` / ``tensorpar_sp``: Column/RowParallelLinear without / with sequence parallelism;
* ``tensorpar_no_overlap``: ``allreduce_dgrad=False``, so the dgrad all-reduce is the
  synchronous ``f`` mapping instead of overlapping the wgrad GEMM;
* ``tensorpar_chunked`` / ``tensorpar_sp_chunked``: ``overlap=--chunks``: every collective on
  the critical path split into chunks, each in flight while the next chunk's GEMM runs;
* ``dtensor`` / ``dtensor_sp``: ``ColwiseParallel``/``RowwiseParallel`` via
  ``parallelize_module``, with ``Shard(0)`` sequence layouts for SP.

Rounds interleave the variants (rotating their order); an iteration's time is the slowest
rank's. Every ratio is taken within a round and reported as the median over rounds, so slow
drift of a shared machine cancels. Before timing, every TP variant's output and gradients are
checked against the unsharded block, so all variants do the same work.

The GPT part (``--gpt-layers`` > 0) times a training step (forward, loss, backward, SP grad
sum, SGD step) of a GPT of the same hidden size, sequence and batch: at TP=1 on rank 0 alone,
and at TP without / with SP, overlap off / chunked, and interleaved halves (Domino); its
losses are checked against TP=1's first. Each variant's CPU time per iteration is split into
the compute thread's and the other threads' (gloo's), from ``/proc``: where overlap is lost.

Example::

    tensorpar bench --tp 2 --seq 256 --batch 4 --hidden 512 --rounds 7
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..distributed import comm
from ..errors import UsageError
from .main import TORCH_COMMANDS
from ..tensor_parallel.overlap import measure_link
from ..parallel_state import destroy_model_parallel, get_tensor_model_parallel_group, initialize_model_parallel
from .bench_variants import (
    COLLECTIVE_TIMEOUT,
    COMPUTE_ONLY,
    DTENSOR_PEER,
    DTYPES,
    GPT_LABELS,
    GPT_TP1,
    GPT_VARIANTS,
    LABELS,
    UNSHARDED,
    VARIANTS,
    BenchConfig,
    build_gpt_variants,
    build_variants,
    Variant,
)
from .launch import launch_local


def _thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds each thread of this process has run (Linux ``/proc`` schedstat; else empty)."""
    seconds = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return seconds
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds[int(tid)] = int(f.read().split()[0]) / 1e9  # ns on the CPU
        except (OSError, ValueError, IndexError):  # the thread ended, or no schedstat
            continue
    return seconds


def _time_iterations(variant: Variant, *, warmup: int, iters: int) -> tuple[list[float], list[float]]:
    """Seconds per iteration, each the slowest rank's, and the CPU ms per iteration of this
    process's compute (main) thread and of its other threads (gloo's), the busiest rank's.

    Iterations run back to back after one barrier, as in training: the collectives keep the
    ranks in step, while a barrier per iteration would add its exit skew to every iteration.
    """
    for _ in range(warmup):
        variant.step()
    main = threading.get_native_id()
    dist.barrier()
    cpu_before = _thread_cpu_seconds()
    stamps = [time.perf_counter()]
    for _ in range(iters):
        variant.step()
        stamps.append(time.perf_counter())
    cpu_after = _thread_cpu_seconds()
    spent = {tid: cpu_after[tid] - cpu_before.get(tid, 0.0) for tid in cpu_after}
    cpu = comm.scalars([spent.get(main, 0.0), sum(v for t, v in spent.items() if t != main)], dtype=torch.float64)
    times = comm.scalars([b - a for a, b in zip(stamps, stamps[1:])], dtype=torch.float64)
    times, cpu = (comm.all_reduce(t, None, op="max").tolist() for t in (times, cpu))
    return times, [ms * 1e3 / iters for ms in cpu]


def _median_ratio(rounds: list[dict[str, float]], numerator: Callable[[dict], float],
                  denominator: Callable[[dict], float]) -> float:
    return statistics.median(numerator(r) / denominator(r) for r in rounds)


def _interleaved_rounds(cfg: BenchConfig, variants: dict, names: tuple[str, ...]):
    """Per round, each variant's median ms and its CPU ms per iteration ``[compute thread, other
    threads]``; the order rotates so no variant always runs first."""
    rounds, cpu_rounds = [], []
    for index in range(cfg.rounds):
        shift = index % len(names)
        result, cpu = {}, {}
        for name in names[shift:] + names[:shift]:
            times, cpu[name] = _time_iterations(variants[name], warmup=cfg.warmup, iters=cfg.iters)
            result[name] = 1e3 * statistics.median(times)
        rounds.append({name: result[name] for name in names})
        cpu_rounds.append(cpu)
    return rounds, cpu_rounds


def _cpu_summary(names, cpu_rounds) -> dict:
    return {v: {"compute_thread_ms": statistics.median(r[v][0] for r in cpu_rounds),
                "other_threads_ms": statistics.median(r[v][1] for r in cpu_rounds)} for v in names}


def _summarise_gpt(cfg: BenchConfig, rounds: list[dict[str, float]]) -> dict:
    return {
        "median_ms": {v: statistics.median(r[v] for r in rounds) for v in GPT_VARIANTS},
        "range_ms": {v: [min(r[v] for r in rounds), max(r[v] for r in rounds)] for v in GPT_VARIANTS},
        "scaling_efficiency": {v: _median_ratio(rounds, lambda r: r[GPT_TP1], lambda r, v=v: cfg.tp * r[v])
                               for v in GPT_VARIANTS[1:]},
        "rounds_ms": rounds,
    }


def _summarise(cfg: BenchConfig, rounds: list[dict[str, float]]) -> dict:
    tp_variants = [v for v in VARIANTS if v != UNSHARDED]
    return {
        "config": {**dataclasses.asdict(cfg), "ffn_hidden": cfg.ffn_hidden, "threads_per_rank": 1,
                   "backend": "gloo", "torch": torch.__version__},
        "median_ms": {v: statistics.median(r[v] for r in rounds) for v in VARIANTS},
        "range_ms": {v: [min(r[v] for r in rounds), max(r[v] for r in rounds)] for v in VARIANTS},
        # >1 means tensorpar is faster.
        "speedup_vs_dtensor": {v: _median_ratio(rounds, lambda r, p=peer: r[p], lambda r, v=v: r[v])
                               for v, peer in DTENSOR_PEER.items()},
        "scaling_efficiency": {v: _median_ratio(rounds, lambda r: r[UNSHARDED], lambda r, v=v: cfg.tp * r[v])
                               for v in tp_variants},
        # The share of the no-communication ceiling each variant reaches: 1 hides all communication.
        "fraction_of_ceiling": {v: _median_ratio(rounds, lambda r: r[COMPUTE_ONLY], lambda r, v=v: r[v])
                                for v in tp_variants if v != COMPUTE_ONLY},
        "overlap_speedup": _median_ratio(rounds, lambda r: r["tensorpar_no_overlap"], lambda r: r["tensorpar"]),
        "rounds_ms": rounds,
    }


def measure(cfg: BenchConfig) -> dict:
    """Run the benchmark on an initialized default process group of ``cfg.tp`` ranks.

    Returns the report (the same on every rank): per-round medians, their medians, ratios.
    """
    if dist.get_world_size() != cfg.tp:
        raise ValueError(f"the benchmark needs a world of exactly --tp {cfg.tp} ranks, "
                         f"got {dist.get_world_size()}")
    initialize_model_parallel(cfg.tp)
    try:
        rounds, cpu_rounds = _interleaved_rounds(cfg, build_variants(cfg), VARIANTS)
        report = _summarise(cfg, rounds)
        report["cpu_ms_per_iteration"] = _cpu_summary(VARIANTS, cpu_rounds)
        if cfg.gpt_layers:
            rounds, cpu_rounds = _interleaved_rounds(cfg, build_gpt_variants(cfg), GPT_VARIANTS)
            report["gpt"] = _summarise_gpt(cfg, rounds)
            report["gpt"]["cpu_ms_per_iteration"] = _cpu_summary(GPT_VARIANTS, cpu_rounds)
        tokens = cfg.seq * cfg.batch  # the MLP's fc2: its GEMM and its exit all-reduce
        report["link_model"] = measure_link(get_tensor_model_parallel_group(), device=torch.device("cpu"),
                                            dtype=DTYPES[cfg.dtype], rows=tokens,
                                            gemm=(cfg.ffn_hidden // cfg.tp, cfg.hidden), comm_elements=tokens * cfg.hidden)
        return report
    finally:
        destroy_model_parallel()


def _rank_entry(cfg: BenchConfig) -> dict:
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        return measure(cfg)
    finally:
        dist.destroy_process_group()


def run(cfg: BenchConfig) -> dict:
    """Start ``cfg.tp`` local gloo ranks, run :func:`measure` on them, return the report."""
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, read as each rank starts
    return launch_local(_rank_entry, cfg, nproc=cfg.tp)[0]


def format_report(report: dict) -> str:
    """The report as a table: medians, spread over rounds, speedups and scaling efficiency."""
    cfg = report["config"]
    lines = [
        f"MLP block {cfg['hidden']} -> {cfg['ffn_hidden']} -> {cfg['hidden']} (GELU), activations "
        f"[s={cfg['seq']}, b={cfg['batch']}, h={cfg['hidden']}], {cfg['dtype']}, forward+backward",
        f"TP={cfg['tp']} on gloo/CPU, {cfg['threads_per_rank']} thread per rank, torch {cfg['torch']}; "
        f"{cfg['rounds']} interleaved rounds x {cfg['iters']} iterations ({cfg['warmup']} warmup)",
        "",
        f"{'variant':<29}{'median ms':>10}{'rounds min-max':>17}{'vs DTensor':>12}{'scaling eff.':>14}"
        f"{'of ceiling':>12}{'CPU ms: compute':>17}{'gloo':>7}",
    ]

    def number(value, suffix=""):
        return "-" if value is None else f"{value:.3f}{suffix}"

    for name in VARIANTS:
        low, high = report["range_ms"][name]
        lines.append(f"{LABELS[name]:<29}{report['median_ms'][name]:>10.2f}{f'{low:.2f}-{high:.2f}':>17}"
                     f"{number(report['speedup_vs_dtensor'].get(name), 'x'):>12}"
                     f"{number(report['scaling_efficiency'].get(name)):>14}"
                     f"{number(report['fraction_of_ceiling'].get(name)):>12}{_cpu(report, name)}")
    lines += [
        "",
        f"overlap on vs off (tensorpar TP): {report['overlap_speedup']:.3f}x; chunked: overlap={cfg['chunks']}",
        "vs DTensor: DTensor time / tensorpar time (>1: tensorpar faster); scaling eff.: "
        "T(unsharded) / (TP x T(variant)); of ceiling: T(TP shards, no comm) / T(variant); all medians of "
        "per-round ratios.",
    ]
    if "gpt" in report:
        gpt = report["gpt"]
        lines += ["", f"GPT training step ({cfg['gpt_layers']} layers, {cfg['gpt_heads']} heads, vocab "
                      f"{cfg['gpt_vocab']}, same h/s/b; forward, loss, backward, SGD step); first-step losses "
                      "checked against TP=1",
                  f"{'variant':<29}{'median ms':>10}{'rounds min-max':>17}{'scaling eff.':>14}"
                  f"{'CPU ms: compute':>17}{'gloo':>7}"]
        for name in GPT_VARIANTS:
            low, high = gpt["range_ms"][name]
            lines.append(f"{GPT_LABELS[name]:<29}{gpt['median_ms'][name]:>10.2f}{f'{low:.2f}-{high:.2f}':>17}"
                         f"{number(gpt['scaling_efficiency'].get(name)):>14}{_cpu(gpt, name)}")
    link = report["link_model"]
    lines += ["", "CPU ms: per iteration on the busiest rank, of the compute thread and of all other threads "
                  "(gloo's workers); compute + gloo near TP x wall / cores means the cores are saturated.",
              f"calibrated link (overlap=\"auto\"'s model): latency {link['latency_s'] * 1e6:.0f} us, "
              f"{link['bytes_per_s'] / 1e9:.2f} GB/s sent per rank, GEMM {link['flops_per_s'] / 1e9:.1f} GFLOP/s, "
              f"measured overlap of a GEMM and an all-reduce {link['overlap']:.2f}"]
    return "\n".join(lines)


def _cpu(report: dict, name: str) -> str:
    cpu = report["cpu_ms_per_iteration"][name]
    return f"{cpu['compute_thread_ms']:>17.2f}{cpu['other_threads_ms']:>7.2f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchConfig()
    parser.add_argument("--tp", type=int, default=defaults.tp, help="tensor-parallel ranks (local processes)")
    parser.add_argument("--seq", type=int, default=defaults.seq, help="sequence length s")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="micro-batch size b")
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden size h")
    parser.add_argument("--ffn-mult", type=int, default=defaults.ffn_mult, help="FFN width = ffn_mult x h")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed iterations per variant and round")
    parser.add_argument("--iters", type=int, default=defaults.iters, help="timed iterations per variant and round")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype, help="parameter and activation dtype")
    parser.add_argument("--chunks", type=int, default=defaults.chunks,
                        help="overlap chunks of the chunked variants")
    parser.add_argument("--gpt-layers", type=int, default=defaults.gpt_layers,
                        help="layers of the GPT whose training step is timed (0: skip the GPT part)")
    parser.add_argument("--gpt-heads", type=int, default=defaults.gpt_heads, help="GPT attention heads")
    parser.add_argument("--gpt-vocab", type=int, default=defaults.gpt_vocab, help="GPT vocabulary size")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--gpu", action="store_true",
                        help="instead: on one GPU, tensorpar's training step against the same model in plain PyTorch "
                             "(GPT-2 small and Llama-3.2-1B shapes, eager and compiled) and batch-1 decoding of a "
                             "Llama-3-8B shape against its weight-streaming floor, one table")
    parser.add_argument("--gpu-models", nargs="+", default=["gpt2-small", "llama-1b"], metavar="SHAPE",
                        help="--gpu's training shapes (gpt2-small, llama-1b, tiny)")
    parser.add_argument("--gpu-decode-model", default="llama3-8b", metavar="SHAPE",
                        help="--gpu's decoding shape (llama3-8b, tiny)")
    parser.add_argument("--gpu-steps", type=int, default=10, help="--gpu's timed training steps a variant")
    parser.add_argument("--gpu-new-tokens", type=int, default=128, help="--gpu's tokens decoded")


def _run_gpu(args: argparse.Namespace) -> int:
    """``--gpu``: both GPU benchmarks, their tables one after the other (or JSON)."""
    from . import gpu_decode_bench, gpu_train_bench

    reports = [gpu_train_bench.main(["--model", model, "--steps", str(args.gpu_steps)]) for model in args.gpu_models]
    reports.append(gpu_decode_bench.main(["--model", args.gpu_decode_model, "--new-tokens", str(args.gpu_new_tokens)]))
    if args.json:
        print(json.dumps(reports, indent=2))
    return 0


def _run_command(args: argparse.Namespace) -> int:
    if args.gpu:
        return _run_gpu(args)
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    try:
        cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k in fields})
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report = run(cfg)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help=TORCH_COMMANDS["bench"][1],
        description="Time an MLP block (column -> GELU -> row) forward and backward: unsharded, tensorpar "
                    "with and without sequence parallelism and overlap, and PyTorch DTensor TP, in "
                    "interleaved rounds on --tp local gloo ranks, each checked against the unsharded block; "
                    "then a GPT training step at TP=1 and at --tp. Reports ratios (medians over rounds)."
                    "\n\nexample:\n  tensorpar bench --tp 2 --seq 256 --batch 4 --hidden 512 --rounds 7")
    add_arguments(parser)
    parser.set_defaults(func=_run_command)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``benchmarks/mlp_vs_dtensor.py``: the ``bench`` flags without the subcommand."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    add_arguments(parser)
    return _run_command(parser.parse_args(argv))

