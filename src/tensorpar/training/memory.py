"""Before launch: whether a run fits the memory of this machine.

:func:`check_memory` compares :func:`tensorpar.planning.memory.gpt_training_memory` (parameters,
gradients, AdamW state and activations per rank, estimated from the config alone) with the
memory each rank has: a CUDA device's, or on CPU the host's available memory shared by its
local ranks (``MemAvailable`` of ``/proc/meminfo``, else ``os.sysconf``).

With ``--pp`` the estimate is per pipeline stage: each PP rank's stages and the micro-batches
the schedule holds in flight on them; the largest is checked and named.

Example::

    check_memory(config, tp=2, dp=1, seq_len=128, micro_batch=16, dtype="fp32", local_ranks=2)
    check_memory(config, tp=1, dp=1, seq_len=128, micro_batch=4, dtype="fp32", local_ranks=2, pp=2,
                 schedule="1f1b", microbatches=8)
"""

from __future__ import annotations

import os

from ..data_parallel.fsdp import MIN_UNIT_MIB
from ..planning.memory import gpt_parameters_per_rank, gpt_training_memory
from ..errors import UsageError


def _gib(nbytes: float) -> str:
    value = nbytes / 2**30
    for unit in ("GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value /= 1024
    return f"{value:,.1f} {unit}"


def host_available_memory() -> int:
    """Bytes of host memory available to new processes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_per_rank(*, local_ranks: int) -> tuple[int, str]:
    """(bytes, what they are) each rank may use: its CUDA device's memory (the smallest device),
    else the host's available memory over ``local_ranks``."""
    import torch

    if torch.cuda.is_available():
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        return total, f"the {_gib(total)} of each CUDA device"
    available = host_available_memory()
    return available // local_ranks, (f"{_gib(available // local_ranks)} per rank ({_gib(available)} of host memory "
                                       f"available to {local_ranks} local ranks)")


def rotary_table_bytes(config, *, tp: int) -> int:
    """The rotary cos/sin tables a model builds for all its ``max_seq_len`` (+ TP) positions at
    once, fp32, with the angles they are computed from."""
    if config.position_embedding != "rope":
        return 0
    return 4 * (config.max_seq_len + tp) * config.head_dim * 4


def _model(config) -> str:
    return (f"{config.num_layers:,} layers, hidden {config.hidden_size:,}, vocabulary {config.vocab_size:,}"
            + (f", {config.max_seq_len:,} positions" if config.position_embedding == "rope" else ""))


def check_inference_memory(config, *, tp: int, tokens: int, local_ranks: int) -> None:
    """Refuse to build a checkpoint's model for ``tokens`` positions (prompt and new tokens) when its
    weights, KV cache and rotary tables per rank exceed what each rank has, naming both."""
    itemsize = config.params_dtype.itemsize
    weights = gpt_parameters_per_rank(config, tp=tp) * itemsize
    cache = (2 * config.num_layers * -(-config.num_query_groups // tp) * config.head_dim
             * min(tokens, config.max_seq_len) * itemsize)
    tables = rotary_table_bytes(config, tp=tp)
    have, what = memory_per_rank(local_ranks=local_ranks)
    if weights + cache + tables > have:
        raise UsageError(f"the checkpoint's model ({_model(config)}) needs an estimated "
                         f"{_gib(weights + cache + tables)} per rank at --tp {tp} (weights {_gib(weights)}, KV cache "
                         f"{_gib(cache)} for {tokens:,} tokens, rotary tables {_gib(tables)}), more than {what}: "
                         "use a larger --tp or fewer --max-new-tokens")


def check_memory(config, *, tp: int, dp: int, seq_len: int, micro_batch: int, dtype: str, local_ranks: int,
                 fsdp: bool = False, cp: int = 1, pp: int = 1, schedule: str = "1f1b", microbatches: int = 1,
                 virtual_stages: int | None = None, min_unit_mib: float = MIN_UNIT_MIB, ep: int = 1) -> None:
    """Refuse a run whose estimated bytes per rank exceed what each rank has, naming both.

    ``cp``: context parallelism divides the activations, FSDP shards over ``dp x cp``; ``ep``
    splits the experts. With
    ``pp > 1`` the estimate is each PP rank's (its stages, and the ``microbatches`` the
    ``schedule`` holds in flight on them: :func:`tensorpar.pipeline_parallel.pipeline_memory`), and the
    largest is checked and named (each stage's FSDP units gathered for the step, whatever
    ``min_unit_mib``, :func:`tensorpar.fully_shard`'s)."""
    sizes = dict(tp=tp, dp=dp, cp=cp, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, fsdp=fsdp, ep=ep)
    where = ""
    if pp > 1:
        from ..planning.pipeline import pipeline_memory

        ranks = pipeline_memory(config, pp_size=pp, schedule=schedule, microbatches=microbatches,
                                virtual_stages=virtual_stages, **sizes)
        need = max(ranks, key=lambda r: r["total"])
        stages = ", ".join(f"stage {s} with {n} micro-batches in flight" for s, n in need["in_flight"].items())
        where = f" on PP rank {need['rank']} of --pp {pp} ({stages} under --pp-schedule {schedule})"
    else:
        need = gpt_training_memory(config, min_unit_mib=min_unit_mib, **sizes)
    tables = rotary_table_bytes(config, tp=tp)
    have, what = memory_per_rank(local_ranks=local_ranks)
    if need["total"] + tables > have:
        parts = [*([f"rotary tables {_gib(tables)}"] if tables else []), f"parameters {_gib(need['parameters'])}",
                 f"gradients {_gib(need['gradients'])}", f"AdamW state {_gib(need['optimizer'])}",
                 f"activations {_gib(need['activations'])} for --micro-batch {micro_batch} x --seq-len {seq_len}"
                 + (f" at --cp {cp}" if cp > 1 else "")]
        if need["buffers"]:
            parts.append(f"pipeline receive buffers {_gib(need['buffers'])}")
        if fsdp:
            parts.append(f"FSDP units gathered {_gib(need['gathered'])}")
        raise UsageError(
            f"the model ({_model(config)}) needs an estimated {_gib(need['total'] + tables)} per rank at --tp {tp}"
            f"{where} ({', '.join(parts)}), more than {what}: choose a smaller model or batch, or a larger --tp"
            + (" or --pp" if pp > 1 else ""))


def check_run_memory(args, config, *, dp: int, seq_len: int, local_ranks: int) -> None:
    """:func:`check_memory` of ``tensorpar train``'s ``args`` (``--tp``, ``--cp``, ``--pp`` and its
    schedule, ``--grad-accum`` micro-batches, ``--micro-batch``, ``--dtype``, ``--fsdp`` and
    ``--fsdp-min-unit-mib``, ``--ep``; under HSDP, ``--dp-replicate`` replicas each shard over ``dp`` / R)."""
    replicas = getattr(args, "dp_replicate", 1) if args.fsdp else 1
    check_memory(config, tp=args.tp, dp=dp // replicas, cp=args.cp, pp=args.pp, schedule=args.pp_schedule,
                 microbatches=args.grad_accum, virtual_stages=args.virtual_stages, seq_len=seq_len,
                 micro_batch=args.micro_batch, dtype=args.dtype, local_ranks=local_ranks, fsdp=args.fsdp,
                 min_unit_mib=args.fsdp_min_unit_mib, ep=getattr(args, "ep", 1))
