"""``tensorpar comm``: the predicted TP collectives of a layer or GPT step, optionally measured.

The prediction is :mod:`tensorpar.planning.communication`'s; with ``--fsdp`` the GPT step's under
:func:`tensorpar.fully_shard` over ``--dp`` ranks, FSDP's all-gathers and reduce-scatters
included (:mod:`tensorpar.planning.fsdp`); with ``--pp`` also the pipeline's sends between stages
and its bubble (:mod:`tensorpar.planning.pipeline`); with ``--cp`` the step over a context-parallel
group (:mod:`tensorpar.planning.context`). ``--measure`` runs the same layer on ``--tp`` (x ``--dp``,
x ``--pp`` or x ``--cp``) spawned gloo ranks under a :class:`tensorpar.CommLedger` (sizes divided
by ``--scale``, :mod:`tensorpar.cli.comm_measure`) and prints each measured collective next to
the predicted one (under ``--pp`` and ``--cp`` on every rank, :mod:`tensorpar.cli.comm_axes`).

Example (seed 002)::

    tensorpar comm --layer column --gather-output --hidden 4096 --seq-len 2048 --batch 1 \\
        --tp 2 --dtype bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


from ..planning.communication import (
    DTYPES, LAYERS, WGRAD_REGATHER, CommConfig, GroupOp, LinkModel, collectives, overlap_plan, summarize)
from ..planning import context as context_model
from ..planning import experts as experts_model
from ..context_parallel import COMM_TYPES
from ..errors import UsageError
from ..planning.fsdp import MIN_UNIT_MIB, FSDPConfig, state_bytes_per_rank, step_collectives, units
from ..planning.memory import activation_memory
from ..pipeline_parallel import SCHEDULES
from ..planning.pipeline import PipelineCost, pipeline_cost, rank_collectives
from .main import TORCH_COMMANDS
from .comm_axes import (any_block, compared, context_json, duration, dtype_name, format_context, format_pipeline,
                        format_ranks, ordered_table, pipeline_json, size, table, unpredicted)
from .comm_measure import check_measurable, gpt_config, measure, measure_ranks, record_key, scaled
from .flag_types import non_negative


# --- formatting ---------------------------------------------------------------------------------

def _fsdp(args) -> FSDPConfig | None:
    return FSDPConfig(dp=args.dp or 2, reshard_after_forward=args.reshard_after_forward,
                      min_unit_mib=args.fsdp_min_unit_mib) if args.fsdp else None


def _context(args) -> context_model.ContextConfig | None:
    if args.cp is None:
        return None
    return context_model.ContextConfig(cp=args.cp, comm_type=args.cp_comm or "p2p", dp=args.dp or 1)


def _ops(cfg: CommConfig, args, *, cp_rank: int = 0) -> list:
    """The predicted collectives: the TP ones, or with ``--fsdp`` the whole TP x FSDP step's, or
    with ``--cp`` CP rank ``cp_rank``'s of the whole CP x TP step."""
    fsdp, context = _fsdp(args), _context(args)
    if context is not None:
        return context_model.step_collectives(cfg, gpt_config(cfg), context, cp_rank=cp_rank, link=_link(args))
    if fsdp is None:
        return collectives(cfg, link=_link(args))
    return step_collectives(cfg, gpt_config(cfg), fsdp, link=_link(args))


def _describe(cfg: CommConfig, args) -> str:
    modes = [m for m, on in (("sp", cfg.sp), ("recompute", cfg.recompute), ("gather_output", cfg.gather_output),
                             ("input not parallel", not cfg.input_is_parallel),
                             (f"overlap {cfg.overlap_chunks}", cfg.overlap_chunks != 1)) if on]
    sizes = (f"hidden={cfg.hidden} ffn={cfg.ffn_hidden} heads={cfg.heads} seq={cfg.seq_len} batch={cfg.batch} "
             f"vocab={cfg.vocab} layers={cfg.layers}")
    fsdp, context = _fsdp(args), _context(args)
    if fsdp:
        count = len(units(gpt_config(cfg), tp=cfg.tp, min_unit_mib=fsdp.min_unit_mib))
        modes.append(f"FSDP over DP={fsdp.dp}" + ("" if fsdp.reshard_after_forward else
                                                  " without resharding after forward")
                     + f" in {count} unit{'s' * (count > 1)}")
    if context:
        modes.append(f"CP={context.cp} ({context.comm_type})" + (f", DP={context.dp}" if context.dp > 1 else ""))
    return f"{cfg.layer} at TP={cfg.tp}, {cfg.dtype}{', ' + ', '.join(modes) if modes else ''} ({sizes})"


def _link(args) -> LinkModel:
    return LinkModel(latency_s=args.latency * 1e-6, bytes_per_s=args.bandwidth * 1e9,
                     flops_per_s=args.tflops * 1e12, overlap=args.overlap_efficiency)


def format_overlap(cfg: CommConfig, args) -> list[str]:
    """The chunks of each chunkable collective and the communication predicted to stay exposed."""
    link, context = _link(args), _context(args)
    plan = context_model.overlap_plan(cfg, context, link) if context else overlap_plan(cfg, link)
    if not plan:
        return []
    rows: dict[tuple, list] = {}
    for entry in plan:
        key = (any_block(entry["layer"]), entry["phase"], entry["op"], entry["chunks"])
        row = rows.setdefault(key, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += entry["exposed_s"]
        row[2] += entry["unchunked_exposed_s"]
    rows_text = table(["layer", "phase", "op", "chunks", "exposed", "unchunked", "x"],
                      [[layer, phase, op, chunks, duration(exposed), duration(unchunked), count]
                       for (layer, phase, op, chunks), (count, exposed, unchunked) in rows.items()])
    chunkable = {(e["layer"], e["phase"], e["op"]) for e in plan}
    others = sum(op.time_s(bandwidth_gbps=args.bandwidth, latency_us=args.latency) for op in _ops(cfg, args)
                 if (op.layer, op.phase, op.op) not in chunkable)
    chosen, unchunked = (sum(e[k] for e in plan) for k in ("exposed_s", "unchunked_exposed_s"))
    return ["", f"overlap ({cfg.overlap_chunks}; link overlap efficiency {args.overlap_efficiency:g}): each "
                "collective chunked against its GEMM, time it adds beyond the GEMM", rows_text,
            f"predicted exposed communication: {duration(chosen + others)} (unchunked: "
            f"{duration(unchunked + others)}), counting every other collective as exposed"]


def _pipeline(cfg: CommConfig, args) -> PipelineCost | None:
    """With ``--pp``: the pipeline's cost (micro-batches default to 2 x PP, which every schedule runs)."""
    if args.pp is None:
        return None
    return pipeline_cost(cfg, pp_size=args.pp, schedule=args.pp_schedule or "1f1b",
                         virtual_stages=args.virtual_stages, microbatches=args.microbatches or 2 * args.pp)


def format_report(cfg: CommConfig, args) -> str:
    """The op table (ops of every GPT layer folded into one row with a count) and totals."""
    ops = _ops(cfg, args)
    link = {"bandwidth_gbps": args.bandwidth, "latency_us": args.latency}
    rows: dict[tuple, list] = {}
    for op in ops:
        what = op.what + (f" [{op.group}]" if isinstance(op, GroupOp) else "")
        key = (op.phase, any_block(op.layer), op.op, op.shape, op.dtype, what)
        rows.setdefault(key, [0, op])[0] += 1
    rows_text = table(["phase", "layer", "op", "shape", "dtype", "bytes", "sent/rank", "est. time", "x", "what"],
                      [[phase, layer, kind, list(shape), dtype_name(dtype), size(op.bytes),
                        size(op.bytes_sent_per_rank), duration(op.time_s(**link)), count, what]
                       for (phase, layer, kind, shape, dtype, what), (count, op) in rows.items()])
    totals = _totals(cfg, ops, args)
    lines = [f"tensorpar comm: {_describe(cfg, args)}", "", rows_text if ops else "(no collectives)", ""]
    for name, t in [("total", totals), *totals["by_phase"].items()]:
        lines.append(f"{name:<10} {t['count']:>4} ops  {size(t['bytes']):>10} tensors  "
                     f"{size(t['bytes_sent_per_rank']):>10} sent/rank  {duration(t['time_s']):>10}")
    lines.append(f"link: {args.bandwidth:g} GB/s per rank, {args.latency:g} us per collective (ring)")
    if totals["comm_share_of_compute"] is not None:
        lines.append(f"compute: {totals['flops_per_rank'] / 1e9:.4g} GFLOP per rank = "
                     f"{duration(totals['compute_time_s'])} at {args.tflops:g} TFLOP/s; communication = "
                     f"{100 * totals['comm_share_of_compute']:.1f}% of it if none overlaps"
                     + (f", at the sizes / {args.scale} that --measure runs (--scale): small sizes are "
                        "latency-bound" if args.measure and args.scale > 1 else ""))
    memory = activation_memory(cfg) if args.cp is None else None  # (the memory model does not divide by CP)
    if memory:
        per = " per GPT layer" if cfg.layer == "gpt-step" else ""
        lines.append(f"activations kept for backward{per}: {size(memory)} per rank")
    fsdp = _fsdp(args)
    if fsdp:
        state = state_bytes_per_rank(gpt_config(cfg), tp=cfg.tp, dp=fsdp.dp)
        lines.append("held between steps (FSDP shards, fp32, AdamW): " + ", ".join(
            f"{what} {size(n)}" for what, n in state.items()) + " per rank")
    cost, context = _pipeline(cfg, args), _context(args)
    return "\n".join(lines + format_overlap(cfg, args) + (format_pipeline(cfg, cost, args) if cost else [])
                     + (format_context(cfg, context, _link(args)) if context else []))


def _totals(cfg: CommConfig, ops: list, args) -> dict:
    """:func:`summarize`'s totals; under ``--cp`` of a CP rank's share of the compute."""
    totals = summarize(cfg, ops, bandwidth_gbps=args.bandwidth, latency_us=args.latency, tflops=args.tflops)
    context = _context(args)
    if context:
        flops = context_model.flops_per_rank(cfg, context)
        compute_s = flops / (args.tflops * 1e12)
        totals.update(flops_per_rank=flops, compute_time_s=compute_s, comm_share_of_compute=totals["time_s"] / compute_s)
    return totals


def report_json(cfg: CommConfig, args) -> dict:
    ops = _ops(cfg, args)
    link = {"bandwidth_gbps": args.bandwidth, "latency_us": args.latency}
    return {
        "config": dataclasses.asdict(cfg),
        "fsdp": dataclasses.asdict(_fsdp(args)) if args.fsdp else None,
        "ops": [{"layer": op.layer, "phase": op.phase, "op": op.op, "shape": list(op.shape),
                 "dtype": dtype_name(op.dtype), "bytes": op.bytes, "bytes_sent_per_rank": op.bytes_sent_per_rank,
                 "time_s": op.time_s(**link), "reduce_op": op.reduce_op, "what": op.what,
                 "group": getattr(op, "group", "tp"), "group_size": op.group_size} for op in ops],
        "totals": _totals(cfg, ops, args),
        "link": link,
        "activation_bytes_per_rank": activation_memory(cfg) if args.cp is None else None,
        "overlap_plan": overlap_plan(cfg, _link(args)),
        "pipeline": pipeline_json(_pipeline(cfg, args), link),
        "context": context_json(cfg, _context(args), _link(args)),
    }


def format_compare(tp_cfg: CommConfig, sp_cfg: CommConfig, args) -> str:
    """TP and TP+SP side by side: ops per phase, bytes, time, activation memory."""
    link = {"bandwidth_gbps": args.bandwidth, "latency_us": args.latency}
    columns = []
    for cfg in (tp_cfg, sp_cfg):
        ops = _ops(cfg, args)
        totals = summarize(cfg, ops, **link, tflops=args.tflops)
        column = {}
        for phase in ("forward", "recompute", "backward", "grads"):
            counts: dict[str, int] = {}
            for op in ops:
                if op.phase == phase:
                    counts[op.op] = counts.get(op.op, 0) + 1
            column[f"{phase} ops"] = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "-"
        column["bytes sent per rank"] = size(totals["bytes_sent_per_rank"])
        # SP's extra traffic: the column layers save only their input shard and re-gather it.
        column["  without wgrad re-gathers"] = size(sum(op.bytes_sent_per_rank for op in ops
                                                         if op.what != WGRAD_REGATHER))
        column["tensor bytes"] = size(totals["bytes"])
        column["est. time"] = duration(totals["time_s"])
        memory = activation_memory(cfg)
        column["activations per layer, per rank"] = size(memory) if memory else "n/a"
        columns.append(column)
    rows = [[name, columns[0][name], columns[1][name]] for name in columns[0]
            if columns[0][name] != "-" or columns[1][name] != "-"]
    return "\n".join([f"tensorpar comm --compare-sp: {_describe(tp_cfg, args)}", "",
                      table(["", "TP", "TP+SP"], rows)])


def format_measured(predicted: list, measured: list[tuple]) -> tuple[str, int]:
    """Predicted ops and measured record keys row by row; returns the text and the mismatch count."""
    text, mismatches = ordered_table(predicted, measured)
    return text + f"\nmeasured {len(measured)} collectives, predicted {len(predicted)}: " + (
        "all agree" if not mismatches else f"{mismatches} differ"), mismatches


# --- command ------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _chunks(text: str) -> int | str:
    return text if text == "auto" else _positive_int(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def register(subparsers) -> None:
    """Add ``tensorpar comm``."""
    p = subparsers.add_parser(
        "comm", help=TORCH_COMMANDS["comm"][1],
        description="Predict the tensor-parallel collectives (count, bytes, time) of one layer or one GPT "
                    "training step, with or without sequence parallelism; --pp adds a pipeline's sends between "
                    "stages and its bubble, --cp context parallelism's collectives and the ring's overlap; "
                    "--measure also runs it on local gloo ranks and compares."
                    "\n\nexample:\n  tensorpar comm --layer column "
                    "--gather-output --hidden 4096 --seq-len 2048 --batch 1 --tp 2 --dtype bf16")
    p.add_argument("--layer", choices=(*LAYERS, experts_model.LAYER), required=True,
                   help="what to predict (moe: an MoE layer's token dispatch over --ep ranks)")
    p.add_argument("--ep", type=_positive_int, default=None, help="with --layer moe: the expert-parallel size (default: 1)")
    p.add_argument("--num-experts", type=_positive_int, default=8, help="with --layer moe: routed experts")
    p.add_argument("--topk", type=_positive_int, default=2, help="with --layer moe: experts per token")
    p.add_argument("--hidden", type=_positive_int, default=4096, help="hidden size")
    p.add_argument("--ffn-hidden", type=_positive_int, default=None, help="MLP width (default: 4 x hidden)")
    p.add_argument("--heads", type=_positive_int, default=32, help="attention heads")
    p.add_argument("--kv-heads", type=_positive_int, default=None,
                   help="K/V heads, grouped-query attention (default: --heads)")
    p.add_argument("--seq-len", type=_positive_int, default=2048, help="sequence length")
    p.add_argument("--batch", type=_positive_int, default=1, help="micro-batch size")
    p.add_argument("--vocab", type=_positive_int, default=50304, help="padded vocabulary size")
    p.add_argument("--layers", type=_positive_int, default=24, help="transformer layers (gpt-step)")
    p.add_argument("--tp", type=_positive_int, default=2, help="tensor-parallel size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="activation dtype (with --fsdp: parameters fp32, gathered in this dtype)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--recompute", action="store_true", help="activation recompute of each layer")
    p.add_argument("--fsdp", action="store_true", help="gpt-step under tp.fully_shard: FSDP's all-gathers and "
                                                      "reduce-scatters over --dp ranks too")
    p.add_argument("--dp", type=_positive_int, default=None,
                   help="with --fsdp: the DP size FSDP shards over (default 2); with --cp: the DP ranks the "
                        "weight grads are also averaged over (default 1)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="with --fsdp: free each unit's gathered parameters after its forward (default: yes; "
                        "no: ZeRO-2-like)")
    p.add_argument("--fsdp-min-unit-mib", type=non_negative(float), default=MIN_UNIT_MIB, metavar="MIB",
                   help="with --fsdp: consecutive blocks make one FSDP unit until it holds MIB MiB of a rank's "
                        f"fp32 parameters; 0: a unit per block (default {MIN_UNIT_MIB:g}, as tp.fully_shard)")
    p.add_argument("--pp", type=_positive_int, default=None,
                   help="with --layer gpt-step: the layers cut into this many pipeline stages; also report "
                        "the sends between stages and the schedule's bubble (default: no pipeline)")
    p.add_argument("--pp-schedule", choices=SCHEDULES, default=None, help="with --pp: the schedule (default: 1f1b)")
    p.add_argument("--virtual-stages", type=_positive_int, default=None,
                   help="with --pp: stages per rank of interleaved-1f1b, looped-bfs, interleaved-zb (default: 2)")
    p.add_argument("--microbatches", type=_positive_int, default=None,
                   help="with --pp: micro-batches per step, each of --batch sequences (default: 2 x PP)")
    p.add_argument("--cp", type=_positive_int, default=None,
                   help="with --layer gpt-step: context parallelism over this many ranks, each holding 2 of "
                        "2 x CP chunks of every sequence (default: none)")
    p.add_argument("--cp-comm", choices=COMM_TYPES, default=None,
                   help="with --cp: a2a (Ulysses all-to-all) or p2p (K/V ring; the default)")
    p.add_argument("--gather-output", action="store_true", help="column layer gathers its output")
    p.add_argument("--input-is-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="row layer input already split on the last dim (default: yes)")
    p.add_argument("--overlap-chunks", type=_chunks, default=1,
                   help="split each TP collective into this many chunks overlapped with its GEMM, or 'auto' "
                        "to choose per collective from the link model (default 1: off)")
    p.add_argument("--overlap-efficiency", type=_fraction, default=1.0,
                   help="share of a GEMM and a concurrent collective that overlaps (default 1: NCCL on a GPU)")
    p.add_argument("--bandwidth", type=_positive_float, default=100.0, help="GB/s per rank (default 100)")
    p.add_argument("--latency", type=_positive_float, default=10.0, help="us per collective (default 10)")
    p.add_argument("--tflops", type=_positive_float, default=100.0, help="TFLOP/s per rank (default 100)")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="machine-readable output")
    output.add_argument("--compare-sp", action="store_true", help="TP and TP+SP side by side")
    output.add_argument("--measure", action="store_true",
                        help="also run it on local gloo ranks (--tp x --dp, --pp or --cp) and compare")
    p.add_argument("--scale", type=_positive_int, default=1,
                   help="with --measure: divide seq-len, hidden, ffn-hidden and vocab by this")
    p.set_defaults(func=run)


def _config(args, **overrides) -> CommConfig:
    fields = dict(layer=args.layer, hidden=args.hidden, ffn_hidden=args.ffn_hidden, heads=args.heads,
                  kv_heads=args.kv_heads, seq_len=args.seq_len, batch=args.batch, vocab=args.vocab, layers=args.layers, tp=args.tp,
                  dtype=args.dtype, sp=args.sp, recompute=args.recompute, gather_output=args.gather_output,
                  input_is_parallel=args.input_is_parallel, overlap_chunks=args.overlap_chunks)
    fields.update(overrides)
    return CommConfig(**fields)


def _check_pipeline_flags(args) -> None:
    """Refuse, in one line, pipeline flags without ``--pp`` and what ``--pp`` does not model."""
    if args.pp is None:
        flags = (("--pp-schedule", args.pp_schedule), ("--virtual-stages", args.virtual_stages),
                 ("--microbatches", args.microbatches))
        given = [flag for flag, value in flags if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply with --pp (the pipeline-parallel size)")
        return
    if args.layer != "gpt-step":
        raise ValueError(f"--pp {args.pp} models a GPT step's stages: use --layer gpt-step, not {args.layer}")
    for flag, on in (("--cp", args.cp is not None), ("--compare-sp", args.compare_sp), ("--fsdp", args.fsdp)):
        if on:
            raise ValueError(f"--pp {args.pp} with {flag} is not supported yet: drop {flag} to get the predicted "
                             "sends between stages and the bubble")


def _check_context_flags(args, cfg: CommConfig) -> None:
    """Refuse, in one line, ``--cp-comm`` without ``--cp`` and what ``--cp`` does not model."""
    if args.cp is None:
        if args.cp_comm is not None:
            raise ValueError("--cp-comm applies with --cp (the context-parallel size)")
        return
    if args.cp == 1:
        raise ValueError("--cp 1 splits nothing: drop --cp, or give a context-parallel size of at least 2")
    for flag, on in (("--compare-sp", args.compare_sp), ("--fsdp", args.fsdp)):
        if on:
            raise ValueError(f"--cp {args.cp} with {flag} is not supported yet: drop {flag}")
    context_model.check(cfg, _context(args))


def _run_experts(args) -> int:
    """``--layer moe``: the dispatch's all-to-alls of one MoE layer on a rank (balanced routing)."""
    for flag, given in (("--measure", args.measure), ("--compare-sp", args.compare_sp), ("--fsdp", args.fsdp),
                        ("--pp", args.pp is not None)):
        if given:
            raise UsageError(f"--layer moe does not take {flag} (tests/test_moe.py compares this model with a run)")
    ep, cp = args.ep or 1, args.cp or 1
    tokens = -(-args.seq_len * args.batch // (args.tp * cp))  # each TP (and CP) rank routes its share
    try:
        ops = experts_model.dispatch_collectives(tokens=tokens, hidden=args.hidden, topk=args.topk,
                                                 num_experts=args.num_experts, ep=ep, dtype=DTYPES[args.dtype],
                                                 tp=args.tp)
    except ValueError as exc:
        raise UsageError(f"--num-experts {args.num_experts} --ep {ep}: {exc}") from None
    link = dict(bandwidth_gbps=args.bandwidth, latency_us=args.latency)
    if args.json:
        print(json.dumps({"tokens_per_rank": tokens, "ops": [
            {"phase": op.phase, "op": op.op, "shape": list(op.shape), "dtype": str(op.dtype).removeprefix("torch."),
             "bytes_sent_per_rank": op.bytes_sent_per_rank, "time_s": op.time_s(**link), "what": op.what}
            for op in ops]}, indent=2))
        return 0
    print(f"MoE layer: {args.num_experts} experts (top {args.topk}) over EP {ep}, {tokens:,} tokens a rank "
          f"(seq {args.seq_len} x batch {args.batch} / TP {args.tp}" + (f" / CP {cp}" if cp > 1 else "")
          + f"), hidden {args.hidden}, {args.dtype}; balanced routing")
    for op in ops:
        print(f"  {op.phase:<8} all_to_all {str(list(op.shape)):<16} {str(op.dtype).removeprefix('torch.'):<8} "
              f"{op.bytes_sent_per_rank / 2**20:10.3f} MiB sent  {op.time_s(**link) * 1e3:8.3f} ms  {op.what}")
    sent, time_s = sum(op.bytes_sent_per_rank for op in ops), sum(op.time_s(**link) for op in ops)
    print(f"total: {len(ops)} collectives, {sent / 2**20:.3f} MiB sent a rank, {time_s * 1e3:.3f} ms at "
          f"{args.bandwidth:g} GB/s and {args.latency:g} us each" if ops else "total: none at EP 1")
    return 0


def run(args) -> int:
    """Print the report; with ``--measure`` exit 1 if measurement and prediction differ."""
    if args.layer == experts_model.LAYER:
        return _run_experts(args)
    if args.ep is not None:
        raise UsageError(f"--ep {args.ep} applies with --layer moe")
    try:
        cfg = _config(args)
        if args.fsdp_min_unit_mib != MIN_UNIT_MIB and not args.fsdp:
            raise ValueError(f"--fsdp-min-unit-mib {args.fsdp_min_unit_mib:g} applies with --fsdp")
        if args.dp is not None and not args.fsdp and args.cp is None:
            raise ValueError(f"--dp {args.dp} applies with --fsdp (the DP size FSDP shards over) or --cp")
        _check_pipeline_flags(args)
        _check_context_flags(args, cfg)
        if args.compare_sp:
            print(format_compare(_config(args, sp=False), _config(args, sp=True), args))
            return 0
        if args.json:
            print(json.dumps(report_json(cfg, args), indent=2))
            return 0
        if args.measure:
            if cfg.overlap_chunks == "auto":
                raise ValueError("--measure needs a fixed --overlap-chunks: the layers' 'auto' decides from "
                                 "their own calibration, not from --bandwidth/--latency/--tflops")
            cfg = scaled(cfg, args.scale)
            check_measurable(cfg)
        _ops(cfg, args)  # FSDP's layer and sizes are checked here
        _pipeline(cfg, args)  # and the pipeline's layout and micro-batches
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(format_report(cfg, args))
    if not args.measure:
        return 0
    fsdp, cost, context = _fsdp(args), _pipeline(cfg, args), _context(args)
    if cfg.tp == 1 and not (fsdp or cost or context):
        print("\n--measure: nothing to measure with one TP rank")
        return 0
    ranks = cfg.tp * (fsdp.dp if fsdp else 1) * (cost.pp_size if cost else 1) * (context.cp * context.dp if context else 1)
    print(f"\nmeasuring on {ranks} local gloo ranks" + (f" (sizes / {args.scale})" if args.scale > 1 else ""))
    sys.stdout.flush()
    if cost:
        text, mismatches = _measured_pipeline(cfg, cost)
    elif context:
        text, mismatches = _measured_context(cfg, context, args)
    else:
        text, mismatches = format_measured(_ops(cfg, args), measure(cfg, fsdp=fsdp))
    print(text)
    return 1 if mismatches else 0


def _measured_pipeline(cfg: CommConfig, cost: PipelineCost) -> tuple[str, int]:
    """Each rank's collectives of a pipelined step against :func:`rank_collectives`, counted by kind."""
    measured = measure_ranks(cfg, pipeline=cost)
    predicted = {rank: rank_collectives(cfg, cost, rank // cfg.tp) for rank in measured}
    note = unpredicted(cfg, cost)
    if note:
        predicted = {rank: [op for op in ops if compared(cfg, cost, record_key(op))] for rank, ops in predicted.items()}
        measured = {rank: [key for key in keys if compared(cfg, cost, key)] for rank, keys in measured.items()}

    def label(rank: int) -> str:
        stages = ", ".join(map(str, cost.layout.stages_of(rank // cfg.tp)))
        return f"rank {rank} (TP rank {rank % cfg.tp}, PP rank {rank // cfg.tp}: stage {stages})"

    text, mismatches = format_ranks(predicted, measured, counted=True, label=label)
    return ("each kind of collective counted (the schedule interleaves them)\n" + (f"{note}\n" if note else "")
            + text.lstrip("\n")), mismatches


def _measured_context(cfg: CommConfig, context, args) -> tuple[str, int]:
    """Each rank's collectives of a CP step against its CP rank's prediction, in issue order."""
    measured = measure_ranks(cfg, context=context)
    predicted = {rank: _ops(cfg, args, cp_rank=rank // cfg.tp % context.cp) for rank in measured}

    def label(rank: int) -> str:
        dp = f", DP rank {rank // (cfg.tp * context.cp)}" if context.dp > 1 else ""
        return f"rank {rank} (TP rank {rank % cfg.tp}, CP rank {rank // cfg.tp % context.cp}{dp})"

    text, mismatches = format_ranks(predicted, measured, counted=False, label=label)
    return text.lstrip("\n"), mismatches
