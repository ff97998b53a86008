"""What ``tensorpar bench`` runs: the MLP block unsharded, as tensorpar's column/row pair and as
DTensor TP (each variant checked against the unsharded block), the GPT training step at TP=1 and
at TP, and the GPU check's overlap variants. Timing and reporting are in :mod:`.bench`.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..distributed import comm
from ..planning.communication import calibrate_overlap
from ..data_parallel.grads import allreduce_sequence_parallel_grads
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..models import GPT, GPTConfig
from ..tensor_parallel.overlap import interleave, median_seconds
from ..parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from ..tensor_parallel.random import model_parallel_manual_seed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Relative to the largest reference entry: sharding reorders sums, and in bf16 each partial sum
# is rounded before the reduction, so entries near zero can differ by a few of the largest's ulps.
_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)

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


def _wait_for_dtensor_collectives(variant: "Variant", out: torch.Tensor) -> None:
    """Finish the output and input-grad collectives DTensor leaves in flight.

    DTensor returns them as lazily awaited tensors; a real model waits when the next layer
    reads them, so a step that never reads them would end with its communication unfinished.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    for tensor in (out, variant.x.grad):
        if isinstance(tensor, AsyncCollectiveTensor):
            tensor.wait()


def _sum_sequence_parallel_grads(variant: "Variant", out: torch.Tensor) -> None:
    """Under SP the row bias grad is partial per rank; DTensor's backward sums it too."""
    allreduce_sequence_parallel_grads(variant.module)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Variant:
    """One way of running the block: ``step()`` is one timed iteration."""

    def __init__(self, module: nn.Module | None, x: torch.Tensor, dy: torch.Tensor, *,
                 sequence_parallel: bool,
                 after_backward: Callable[["Variant", torch.Tensor], None] | None = None):
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


def build_variants(cfg: BenchConfig) -> dict[str, Variant]:
    torch.manual_seed(0)  # same weights and data on every rank
    dtype = DTYPES[cfg.dtype]
    full = MLP(cfg.hidden, cfg.ffn_hidden).to(dtype)
    x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, dtype=dtype)
    dy = torch.randn(cfg.seq, cfg.batch, cfg.hidden, dtype=dtype)
    mesh = init_device_mesh("cpu", (cfg.tp,))
    variants = {
        UNSHARDED: Variant(full if dist.get_rank() == 0 else None, x, dy, sequence_parallel=False),
        COMPUTE_ONLY: Variant(_load_shards(MLP(cfg.hidden, cfg.ffn_hidden // cfg.tp).to(dtype), full), x, dy,
                               sequence_parallel=False),
        "tensorpar": Variant(TensorparMLP(full, sequence_parallel=False, allreduce_dgrad=True), x, dy,
                              sequence_parallel=False),
        "tensorpar_sp": Variant(TensorparMLP(full, sequence_parallel=True, allreduce_dgrad=True), x, dy,
                                 sequence_parallel=True, after_backward=_sum_sequence_parallel_grads),
        "tensorpar_no_overlap": Variant(TensorparMLP(full, sequence_parallel=False, allreduce_dgrad=False),
                                         x, dy, sequence_parallel=False),
        "tensorpar_chunked": Variant(TensorparMLP(full, sequence_parallel=False, overlap=cfg.chunks), x, dy,
                                      sequence_parallel=False),
        "tensorpar_sp_chunked": Variant(TensorparMLP(full, sequence_parallel=True, overlap=cfg.chunks), x, dy,
                                         sequence_parallel=True, after_backward=_sum_sequence_parallel_grads),
        "dtensor": Variant(_dtensor_mlp(full, mesh, sequence_parallel=False), x, dy, sequence_parallel=False,
                            after_backward=_wait_for_dtensor_collectives),
        "dtensor_sp": Variant(_dtensor_mlp(full, mesh, sequence_parallel=True), x, dy, sequence_parallel=True,
                               after_backward=_wait_for_dtensor_collectives),
    }
    expected = Variant(full, x, dy, sequence_parallel=False).results()
    for name, variant in variants.items():
        if name not in (UNSHARDED, COMPUTE_ONLY):
            variant.check_against(expected, name)
    return variants


class GPTStep:
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


def build_gpt_variants(cfg: BenchConfig) -> dict[str, GPTStep]:
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
    variants = {GPT_TP1: GPTStep(gpt(singles[0]) if dist.get_rank() == 0 else None, tokens, labels)}
    for name, options in (("gpt", {}), ("gpt_chunked", dict(overlap=cfg.chunks)), ("gpt_interleaved", dict(interleave=2)),
                          ("gpt_sp", dict(sequence_parallel=True)),
                          ("gpt_sp_chunked", dict(sequence_parallel=True, overlap=cfg.chunks))):
        variants[name] = GPTStep(gpt(tp_group, **options), tokens, labels)
    reference = variants[GPT_TP1].step()
    if reference is None:
        reference = torch.zeros((), dtype=torch.float32, device=comm.collective_device())
    dist.broadcast(reference, src=0)
    for name in GPT_VARIANTS[1:]:
        loss = variants[name].step()
        torch.testing.assert_close(loss, reference, rtol=_RTOL[dtype], atol=0,
                                   msg=lambda m, name=name: f"{name}: first-step loss differs from TP=1's: {m}")
    return variants



def measure_overlap_variants(device: torch.device, *, hidden: int, seq: int, batch: int, dtype: torch.dtype,
                             iters: int = 10) -> dict:
    """ms per MLP block forward + backward on this device at the current TP size: overlap off,
    2 and 4 chunks and ``"auto"``, without and with SP, and interleaved halves, next to the same
    shards' GEMMs with no communication (the ceiling). Each variant's output and input grad are
    checked against overlap off first. Needs ``initialize_model_parallel``; for the GPU check.
    """
    n = get_tensor_model_parallel_world_size()
    rank = get_tensor_model_parallel_rank()

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
        elapsed = comm.scalars(median_seconds(step, device, reps=iters) * 1e3, dtype=torch.float64)
        results[name] = comm.all_reduce(elapsed, None, op="max").item()
    return {"ms": results, "of_ceiling": {k: results["ceiling"] / v for k, v in results.items() if k != "ceiling"},
            "shape": [seq, batch, hidden], "dtype": str(dtype), "tp": n}
