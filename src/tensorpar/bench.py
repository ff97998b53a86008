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
import copy
import dataclasses
import datetime
import json
import os
import statistics
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from . import comm
from .comm_model import calibrate_overlap
from .errors import UsageError
from .grads import allreduce_sequence_parallel_grads
from .launch import launch_local
from .linear import ColumnParallelLinear, RowParallelLinear
from .models.gpt import GPT, GPTConfig
from .overlap import interleave, measure_link
from .parallel_state import (
    destroy_model_parallel,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
)
from .random import model_parallel_manual_seed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Relative to the largest reference entry: sharding reorders sums, and in bf16 each partial sum
# is rounded before the reduction, so entries near zero can differ by a few of the largest's ulps.
_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)

UNSHARDED = "unsharded"
COMPUTE_ONLY = "compute_only"
VARIANTS = (UNSHARDED, COMPUTE_ONLY, "tensorpar", "tensorpar_sp", "tensorpar_no_overlap", "tensorpar_chunked",
            "tensorpar_sp_chunked", "dtensor", "dtensor_sp")
LABELS = {
    UNSHARDED: "unsharded (1 process)",
    COMPUTE_ONLY: "TP shards, no comm",
    "tensorpar": "tensorpar TP",
    "tensorpar_sp": "tensorpar TP+SP",
    "tensorpar_no_overlap": "tensorpar TP, overlap off",
    "tensorpar_chunked": "tensorpar TP, chunked",
    "tensorpar_sp_chunked": "tensorpar TP+SP, chunked",
    "dtensor": "DTensor TP",
    "dtensor_sp": "DTensor TP+SP",
}
# Each tensorpar variant against the DTensor variant doing the same communication pattern.
DTENSOR_PEER = {"tensorpar": "dtensor", "tensorpar_sp": "dtensor_sp", "tensorpar_no_overlap": "dtensor",
                "tensorpar_chunked": "dtensor", "tensorpar_sp_chunked": "dtensor_sp"}
GPT_TP1 = "gpt_tp1"
GPT_VARIANTS = (GPT_TP1, "gpt", "gpt_chunked", "gpt_interleaved", "gpt_sp", "gpt_sp_chunked")
GPT_LABELS = {GPT_TP1: "GPT step, TP=1 (1 process)", "gpt": "GPT step, TP", "gpt_chunked": "GPT step, TP, chunked",
              "gpt_interleaved": "GPT step, TP, interleave=2", "gpt_sp": "GPT step, TP+SP",
              "gpt_sp_chunked": "GPT step, TP+SP, chunked"}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Sizes (activations ``[seq, batch, hidden]``, FFN width ``ffn_mult * hidden``) and repetitions."""

    tp: int = 2
    seq: int = 256
    batch: int = 4
    hidden: int = 512
    ffn_mult: int = 4
    rounds: int = 5
    warmup: int = 2
    iters: int = 10
    dtype: str = "fp32"
    chunks: int = 2
    gpt_layers: int = 2
    gpt_heads: int = 8
    gpt_vocab: int = 1024

    def __post_init__(self) -> None:
        if self.tp < 2:
            raise ValueError(f"--tp must be at least 2 (TP=1 has nothing to compare), got {self.tp}")
        for name in ("seq", "batch", "hidden", "ffn_mult", "rounds", "iters", "chunks", "gpt_heads", "gpt_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("warmup", "gpt_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be non-negative, got {getattr(self, name)}")
        if self.gpt_layers and (self.hidden % self.gpt_heads or self.gpt_heads % self.tp):
            raise ValueError(f"--hidden {self.hidden} must be divisible by --gpt-heads {self.gpt_heads}, "
                             f"and --gpt-heads by --tp {self.tp}")
        for name, size in (("seq", self.seq), ("hidden", self.hidden), ("ffn", self.ffn_hidden)):
            if size % self.tp:
                raise ValueError(f"{name} size {size} is not divisible by --tp {self.tp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_mult * self.hidden


class MLP(nn.Module):
    """The unsharded block, also the module DTensor parallelizes."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TensorparMLP(nn.Module):
    """The same block from tensorpar's layers, holding this rank's shards of ``full``'s weights."""

    def __init__(self, full: MLP, *, sequence_parallel: bool, allreduce_dgrad: bool = True,
                 overlap: int | str = "off") -> None:
        super().__init__()
        hidden, ffn_hidden = full.fc1.in_features, full.fc1.out_features
        dtype = full.fc1.weight.dtype
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, sequence_parallel=sequence_parallel,
                                        allreduce_dgrad=allreduce_dgrad, params_dtype=dtype,
                                        perform_initialization=False, overlap=overlap)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, input_is_parallel=True,
                                     sequence_parallel=sequence_parallel, params_dtype=dtype,
                                     perform_initialization=False, overlap=overlap)
        _load_shards(self, full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)[0]))[0]


def _shard(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return tensor.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


def _shard_like(full: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's part of parameter ``name``: column layer by rows, row layer by columns."""
    if name.startswith("fc1."):
        return _shard(full, 0)
    return _shard(full, 1) if name == "fc2.weight" else full


@torch.no_grad()
def _load_shards(module: nn.Module, full: MLP) -> nn.Module:
    """Copy this rank's shard of each of ``full``'s parameters into ``module``'s namesake."""
    for name, param in module.named_parameters():
        param.copy_(_shard_like(full.get_parameter(name), name))
    return module


def _dtensor_mlp(full: MLP, mesh, *, sequence_parallel: bool) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if sequence_parallel:
        plan = {"fc1": ColwiseParallel(input_layouts=Shard(0)), "fc2": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return parallelize_module(copy.deepcopy(full), mesh, plan)


def _wait_for_dtensor_collectives(variant: "_Variant", out: torch.Tensor) -> None:
    """Finish the output and input-grad collectives DTensor leaves in flight.

    DTensor returns them as lazily awaited tensors; a real model waits when the next layer
    reads them, so a step that never reads them would end with its communication unfinished.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    for tensor in (out, variant.x.grad):
        if isinstance(tensor, AsyncCollectiveTensor):
            tensor.wait()


def _sum_sequence_parallel_grads(variant: "_Variant", out: torch.Tensor) -> None:
    """Under SP the row bias grad is partial per rank; DTensor's backward sums it too."""
    allreduce_sequence_parallel_grads(variant.module)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _Variant:
    """One way of running the block: ``step()`` is one timed iteration."""

    def __init__(self, module: nn.Module | None, x: torch.Tensor, dy: torch.Tensor, *,
                 sequence_parallel: bool,
                 after_backward: Callable[["_Variant", torch.Tensor], None] | None = None):
        self.module = module  # None: this rank sits the variant out
        self.sequence_parallel = sequence_parallel
        self.x = (_shard(x, 0) if sequence_parallel else x).clone().requires_grad_()
        self.dy = _shard(dy, 0) if sequence_parallel else dy
        self.after_backward = after_backward

    def step(self) -> torch.Tensor | None:
        if self.module is None:
            return None
        self.module.zero_grad(set_to_none=True)
        self.x.grad = None
        out = self.module(self.x)
        out.backward(self.dy)
        if self.after_backward is not None:
            self.after_backward(self, out)
        return out

    def results(self) -> dict[str, torch.Tensor]:
        """One step's output, input grad and parameter grads (this rank's parts)."""
        got = {"output": self.step().detach(), "input grad": self.x.grad}
        got.update({f"{n} grad": _local(p.grad) for n, p in self.module.named_parameters()})
        return got

    def check_against(self, reference: dict[str, torch.Tensor], name: str) -> None:
        """Assert output and every gradient equal this rank's slice of the unsharded block's."""
        for key, value in self.results().items():
            expected = reference[key]
            if key in ("output", "input grad"):
                expected = _shard(expected, 0) if self.sequence_parallel else expected
            else:
                expected = _shard_like(expected, key.removesuffix(" grad"))
            rtol = _RTOL[value.dtype]
            torch.testing.assert_close(value, expected, rtol=rtol, atol=rtol * expected.abs().max().item(),
                                       msg=lambda m, k=key: f"{name}: {k} differs from the unsharded block: {m}")


def _build_variants(cfg: BenchConfig) -> dict[str, _Variant]:
    torch.manual_seed(0)  # same weights and data on every rank
    dtype = DTYPES[cfg.dtype]
    full = MLP(cfg.hidden, cfg.ffn_hidden).to(dtype)
    x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, dtype=dtype)
    dy = torch.randn(cfg.seq, cfg.batch, cfg.hidden, dtype=dtype)
    mesh = init_device_mesh("cpu", (cfg.tp,))
    variants = {
        UNSHARDED: _Variant(full if dist.get_rank() == 0 else None, x, dy, sequence_parallel=False),
        COMPUTE_ONLY: _Variant(_load_shards(MLP(cfg.hidden, cfg.ffn_hidden // cfg.tp).to(dtype), full), x, dy,
                               sequence_parallel=False),
        "tensorpar": _Variant(TensorparMLP(full, sequence_parallel=False, allreduce_dgrad=True), x, dy,
                              sequence_parallel=False),
        "tensorpar_sp": _Variant(TensorparMLP(full, sequence_parallel=True, allreduce_dgrad=True), x, dy,
                                 sequence_parallel=True, after_backward=_sum_sequence_parallel_grads),
        "tensorpar_no_overlap": _Variant(TensorparMLP(full, sequence_parallel=False, allreduce_dgrad=False),
                                         x, dy, sequence_parallel=False),
        "tensorpar_chunked": _Variant(TensorparMLP(full, sequence_parallel=False, overlap=cfg.chunks), x, dy,
                                      sequence_parallel=False),
        "tensorpar_sp_chunked": _Variant(TensorparMLP(full, sequence_parallel=True, overlap=cfg.chunks), x, dy,
                                         sequence_parallel=True, after_backward=_sum_sequence_parallel_grads),
        "dtensor": _Variant(_dtensor_mlp(full, mesh, sequence_parallel=False), x, dy, sequence_parallel=False,
                            after_backward=_wait_for_dtensor_collectives),
        "dtensor_sp": _Variant(_dtensor_mlp(full, mesh, sequence_parallel=True), x, dy, sequence_parallel=True,
                               after_backward=_wait_for_dtensor_collectives),
    }
    expected = _Variant(full, x, dy, sequence_parallel=False).results()
    for name, variant in variants.items():
        if name not in (UNSHARDED, COMPUTE_ONLY):
            variant.check_against(expected, name)
    return variants


class _GPTStep:
    """One GPT training step: forward, loss, backward, SP grad sum, SGD step."""

    def __init__(self, model: GPT | None, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        self.model, self.tokens, self.labels = model, tokens, labels  # model None: sit out
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) if model is not None else None

    def step(self) -> torch.Tensor | None:
        if self.model is None:
            return None
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.tokens, self.labels)
        loss.backward()
        allreduce_sequence_parallel_grads(self.model, tp_group=self.model.tp_group)
        self.optimizer.step()
        return loss.detach()


def _build_gpt_variants(cfg: BenchConfig) -> dict[str, _GPTStep]:
    """The GPT step at TP=1 (rank 0) and at TP; checks each first step's loss against TP=1's."""
    dtype = DTYPES[cfg.dtype]
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates each

    def gpt(group, **options):
        model_parallel_manual_seed(0, tp_group=group)
        return GPT(GPTConfig(vocab_size=cfg.gpt_vocab, max_seq_len=cfg.seq, num_layers=cfg.gpt_layers,
                             num_heads=cfg.gpt_heads, hidden_size=cfg.hidden, ffn_hidden_size=cfg.ffn_hidden,
                             params_dtype=dtype, **options), tp_group=group)

    generator = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.gpt_vocab, (cfg.batch, cfg.seq), generator=generator) for _ in range(2))
    tp_group = get_tensor_model_parallel_group()
    variants = {GPT_TP1: _GPTStep(gpt(singles[0]) if dist.get_rank() == 0 else None, tokens, labels)}
    for name, options in (("gpt", {}), ("gpt_chunked", dict(overlap=cfg.chunks)), ("gpt_interleaved", dict(interleave=2)),
                          ("gpt_sp", dict(sequence_parallel=True)),
                          ("gpt_sp_chunked", dict(sequence_parallel=True, overlap=cfg.chunks))):
        variants[name] = _GPTStep(gpt(tp_group, **options), tokens, labels)
    reference = variants[GPT_TP1].step()
    if reference is None:
        reference = torch.zeros((), dtype=torch.float32, device=comm.collective_device())
    dist.broadcast(reference, src=0)
    for name in GPT_VARIANTS[1:]:
        loss = variants[name].step()
        torch.testing.assert_close(loss, reference, rtol=_RTOL[dtype], atol=0,
                                   msg=lambda m, name=name: f"{name}: first-step loss differs from TP=1's: {m}")
    return variants


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


def _time_iterations(variant: _Variant, *, warmup: int, iters: int) -> tuple[list[float], list[float]]:
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
        rounds, cpu_rounds = _interleaved_rounds(cfg, _build_variants(cfg), VARIANTS)
        report = _summarise(cfg, rounds)
        report["cpu_ms_per_iteration"] = _cpu_summary(VARIANTS, cpu_rounds)
        if cfg.gpt_layers:
            rounds, cpu_rounds = _interleaved_rounds(cfg, _build_gpt_variants(cfg), GPT_VARIANTS)
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
    dist.init_process_group("gloo", timeout=_COLLECTIVE_TIMEOUT)
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


def _run_command(args: argparse.Namespace) -> int:
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
        "bench", help="MLP block tensorpar vs DTensor TP on gloo/CPU",
        description="Time an MLP block (column -> GELU -> row) forward and backward: unsharded, tensorpar "
                    "with and without sequence parallelism and overlap, and PyTorch DTensor TP, in "
                    "interleaved rounds on --tp local gloo ranks, each checked against the unsharded block; "
                    "then a GPT training step at TP=1 and at --tp. Reports ratios (medians over rounds)."
                    "\n\nexample:\n  tensorpar bench --tp 2 --seq 256 --batch 4 --hidden 512 --rounds 7")
    add_arguments(parser)
    parser.set_defaults(func=_run_command)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``benchmarks/mlp_vs_dtensor.py``: the ``bench`` flags without the subcommand."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return _run_command(parser.parse_args(argv))


def measure_overlap_variants(device: torch.device, *, hidden: int, seq: int, batch: int, dtype: torch.dtype,
                             iters: int = 10) -> dict:
    """ms per MLP block forward + backward on this device at the current TP size: overlap off,
    2 and 4 chunks and ``"auto"``, without and with SP, and interleaved halves, next to the same
    shards' GEMMs with no communication (the ceiling). Each variant's output and input grad are
    checked against overlap off first. Needs ``initialize_model_parallel``; for the GPU check.
    """
    n = get_tensor_model_parallel_world_size()
    rank = get_tensor_model_parallel_rank()

    def sync():
        if device.type != "cpu":
            torch.accelerator.synchronize()

    def tensorpar_block(sp, overlap, interleaved):
        model_parallel_manual_seed(0, device=device)
        fc1 = ColumnParallelLinear(hidden, 4 * hidden, sequence_parallel=sp, overlap=overlap, params_dtype=dtype,
                                   device=device)
        fc2 = RowParallelLinear(4 * hidden, hidden, input_is_parallel=True, sequence_parallel=sp, overlap=overlap,
                                params_dtype=dtype, device=device)
        calibrate_overlap(nn.ModuleList([fc1, fc2]), tokens=seq * batch)
        if interleaved:
            stage = (lambda h: fc2.start(F.gelu(fc1(h)[0])), lambda h, reduced: reduced[0])
            return lambda x: interleave(x, [stage], parts=2)
        return lambda x: fc2(F.gelu(fc1(x)[0]))[0]

    generator = torch.Generator(device="cpu").manual_seed(1)
    x_full = torch.randn(seq, batch, hidden, generator=generator, device="cpu").to(device=device, dtype=dtype)
    with device:  # built where it runs
        variants = {"ceiling": (MLP(hidden, 4 * hidden // n).to(dtype=dtype), False)}
    for sp in (False, True):
        suffix = "_sp" if sp else ""
        for overlap in ("off", 2, 4, "auto"):
            variants[f"overlap_{overlap}{suffix}"] = (tensorpar_block(sp, overlap, False), sp)
        variants[f"interleave2{suffix}"] = (tensorpar_block(sp, "off", True), sp)
    results, reference = {}, {}
    for name, (block, sp) in variants.items():
        x = (x_full.chunk(n)[rank] if sp else x_full).clone().requires_grad_()

        def step():
            x.grad = None
            y = block(x)
            y.backward(torch.ones_like(y))
            return y

        y = step()
        key = "sp" if sp else "tp"
        if name != "ceiling":
            if key not in reference:
                reference[key] = (y.detach(), x.grad)
            tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
            torch.testing.assert_close(y.detach(), reference[key][0], **tol, msg=lambda m, name=name: f"{name}: {m}")
            torch.testing.assert_close(x.grad, reference[key][1], **tol, msg=lambda m, name=name: f"{name}: {m}")
        times = []
        for _ in range(iters):
            sync()
            begin = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - begin)
        elapsed = comm.scalars(statistics.median(times) * 1e3, dtype=torch.float64)
        results[name] = comm.all_reduce(elapsed, None, op="max").item()
    return {"ms": results, "of_ceiling": {k: results["ceiling"] / v for k, v in results.items() if k != "ceiling"},
            "shape": [seq, batch, hidden], "dtype": str(dtype), "tp": n}
