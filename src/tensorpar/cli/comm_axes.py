"""``tensorpar comm --pp`` and ``--cp``: the pipeline's and context parallelism's parts of the
report, and ``--measure``'s comparison on every rank.

Under ``--pp`` each rank's predicted collectives (:func:`tensorpar.planning.pipeline.rank_collectives`)
are compared with what it measured as counts of each kind (phase, op, shape, dtype, bytes,
group size): the schedule decides the order. Under ``--cp`` (:mod:`tensorpar.planning.context`) they
are compared in issue order, collective by collective, as without either.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re

import torch

from ..planning.communication import DTYPES, CommConfig, CommOp
from ..planning.context import ContextConfig, attention_comm, chunks, ring_overlap, transfer_seconds
from ..planning.pipeline import PipelineCost
from ..planning.pipeline import SPLIT_BACKWARD
from .comm_measure import record_key


def size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in [header, *rows])


# --- the pipeline ---------------------------------------------------------------------------------

def format_pipeline(cfg: CommConfig, cost: PipelineCost, args) -> list[str]:
    """The bytes of one send between stages, each rank's sends per step, and the bubble."""
    link = {"bandwidth_gbps": args.bandwidth, "latency_us": args.latency}
    rows = table(["rank", "stages", "activation sends", "gradient sends", "recvs", "sent/rank", "est. time"],
                 [[r.rank, ", ".join(map(str, r.stages)), r.activation_sends, r.gradient_sends, r.recvs,
                   size(r.sends * cost.bytes_per_send), duration(r.sends * cost.send_time_s(**link))]
                  for r in cost.ranks])
    bubble = (f"{100 * cost.bubble:.1f}% of the step, {cost.bubble_formula} (stages of equal time)"
              if cost.bubble is not None else cost.bubble_formula)
    return ["", f"pipeline: PP={cost.pp_size}, {cost.schedule}, {cost.stages_per_rank} stage(s) per rank, "
                f"{cost.microbatches} micro-batches per step of {cfg.batch} x {cfg.seq_len} tokens; "
                f"{cost.layout.describe()}",
            f"per send: one micro-batch's hidden states {list(cost.send_shape)} {dtype_name(cost.dtype)} = "
            f"{size(cost.bytes_per_send)} forward, their gradient the same backward, "
            f"{duration(cost.send_time_s(**link))} each",
            "sends per step (each TP rank of a stage sends its own; stages on one rank send nothing):", rows,
            f"bubble: {bubble}",
            "the TP collectives above are one micro-batch's through the whole model: a stage issues its own "
            "layers' once per micro-batch"]


def pipeline_json(cost: PipelineCost | None, link: dict) -> dict | None:
    if cost is None:
        return None
    return {"schedule": cost.schedule, "pp_size": cost.pp_size, "stages_per_rank": cost.stages_per_rank,
            "microbatches": cost.microbatches, "layers_per_stage": [[r.start, r.stop] for r in cost.layout.layers],
            "send_shape": list(cost.send_shape), "dtype": dtype_name(cost.dtype),
            "bytes_per_send": cost.bytes_per_send, "send_time_s": cost.send_time_s(**link),
            "ranks": [dataclasses.asdict(r) for r in cost.ranks], "bubble": cost.bubble,
            "bubble_formula": cost.bubble_formula}


def unpredicted(cfg: CommConfig, cost: PipelineCost) -> str | None:
    """Why some of ``cost``'s measured collectives are left out of the comparison (None: none are)."""
    if cost.schedule not in SPLIT_BACKWARD or cfg.tp == 1:
        return None
    return (f"the {cost.schedule} schedule splits each backward into an input and a weight pass, and the weight "
            "pass runs the TP layers' backward again as many times as torch's split needs: its backward TP "
            "collectives are not predicted exactly and are left out (the sends, receives and the rest are compared)")


def compared(cfg: CommConfig, cost: PipelineCost, key: tuple) -> bool:
    """Whether the collective of ``key`` (phase, op, ...) is compared: not one :func:`unpredicted` names."""
    phase, op = key[:2]
    return unpredicted(cfg, cost) is None or phase not in ("backward", "recompute") or op in ("send", "recv")


# --- context parallelism --------------------------------------------------------------------------

def format_context(cfg: CommConfig, cp: ContextConfig, link) -> list[str]:
    """The sequence's chunks, attention's CP collectives per layer and, for the ring, the
    compute/communication overlap."""
    mine = chunks(cfg, cp)
    padded = f" padded to {mine.padded_len}," if mine.padding else ""
    how = "a2a: Ulysses all-to-all" if cp.comm_type == "a2a" else "p2p: K/V ring"
    lines = ["", f"context parallelism: CP={cp.cp} ({how}); each sequence of {cfg.seq_len} tokens{padded} cut in "
                 f"{2 * cp.cp} chunks of {mine.chunk_len}, CP rank i holding chunks i and {2 * cp.cp - 1}-i: "
                 f"{mine.local_len} tokens per rank in every TP collective; weight grads averaged over "
                 f"DP x CP = {cp.dp * cp.cp} ranks"]
    comm = attention_comm(heads=cfg.heads // cfg.tp, kv_heads=cfg.kv_heads // cfg.tp, head_dim=cfg.hidden // cfg.heads,
                          batch=cfg.batch, local_len=mine.local_len, cp=cp.cp, cp_rank=0, comm_type=cp.comm_type,
                          dtype=cfg.torch_dtype, tp=cfg.tp)
    ops = comm.forward + comm.backward
    seconds = sum(transfer_seconds(op, link) for op in ops)
    lines.append(f"attention's collectives per layer on CP rank 0: {len(comm.forward)} forward, {len(comm.backward)} "
                 f"backward, {size(sum(op.bytes_sent_per_rank for op in ops))} sent, {duration(seconds)}"
                 + (" (again in the recompute)" if cfg.recompute else ""))
    if cp.comm_type == "a2a":
        return lines + ["overlap: none; each all-to-all waits for attention's input or output"]
    rows = ring_overlap(cfg, cp, link)
    lines += [f"ring overlap per layer (link overlap efficiency {link.overlap:g}): in ring step t each rank attends "
              "to the K/V in hand while the next travel (backward: with the dK/dV so far)",
              table(["phase", "ring steps", "communication", "attention", "exposed", "hidden"],
                    [[r["phase"], r["steps"], duration(r["communication_s"]), duration(r["compute_s"]),
                      duration(r["exposed_s"]), f"{100 * _hidden(r):.0f}%"] for r in rows])]
    total = {k: sum(r[k] for r in rows) for k in ("communication_s", "exposed_s")}
    lines.append(f"predicted compute/communication overlap: {100 * _hidden(total):.0f}% of the ring's communication "
                 f"hidden behind attention, {duration(total['exposed_s'] * cfg.layers)} exposed per step "
                 f"({cfg.layers} layers)")
    return lines


def _hidden(row: dict) -> float:
    return 1 - row["exposed_s"] / row["communication_s"] if row["communication_s"] else 1.0


def context_json(cfg: CommConfig, cp: ContextConfig | None, link) -> dict | None:
    if cp is None:
        return None
    mine = chunks(cfg, cp)
    return {**dataclasses.asdict(cp), "chunk_len": mine.chunk_len, "local_len": mine.local_len,
            "padded_len": mine.padded_len,
            "ring_overlap": ring_overlap(cfg, cp, link) if cp.comm_type == "p2p" else None}


def any_block(layer: str) -> str:
    """``layer`` with its block index (``blocks.3.mlp``) or FSDP unit's blocks (``blocks.0-1``) as
    ``blocks.*``, so that a table folds every block's rows into one."""
    return re.sub(r"^blocks\.\d+(-\d+)?", "blocks.*", layer)


# --- measured on every rank -----------------------------------------------------------------------

def _layers(ops: list[CommOp]) -> str:
    names = list(dict.fromkeys(any_block(op.layer) for op in ops))
    return (names[0] + (f" (+{len(names) - 1} more)" if len(names) > 1 else "")) if names else "-"


def _cells(key) -> list[str]:
    phase, op, shape, dtype, nbytes, _, group = key
    return [phase, op, f"{list(shape)} {dtype}", str(nbytes), str(group)]


def counted_table(predicted: list[CommOp], measured: list[tuple]) -> tuple[str, int]:
    """Each kind of collective, predicted and measured counts side by side; the kinds that differ."""
    by_key: dict[tuple, list[CommOp]] = {}
    for op in predicted:
        by_key.setdefault(record_key(op), []).append(op)
    counts = collections.Counter(measured)
    rows, differ = [], 0
    for key in [*by_key, *(k for k in counts if k not in by_key)]:
        same = len(by_key.get(key, ())) == counts[key]
        differ += not same
        rows.append([_layers(by_key.get(key, [])), *_cells(key), str(len(by_key.get(key, ()))), str(counts[key]),
                     "ok" if same else "DIFFERS"])
    return table(["layer", "phase", "op", "shape", "bytes", "ranks", "predicted", "measured", ""], rows), differ


def ordered_table(predicted: list[CommOp], measured: list[tuple]) -> tuple[str, int]:
    """Predicted and measured collectives row by row, in issue order; the rows that differ."""
    rows, differ = [], 0
    for i, (p, m) in enumerate(itertools.zip_longest(predicted, measured)):
        expected = record_key(p) if p is not None else None
        same = expected == m
        differ += not same
        rows.append([str(i + 1), p.layer if p is not None else "-", *(_cells(expected) if expected else ["-"] * 5),
                     *(_cells(m) if m else ["-"] * 5), "ok" if same else "DIFFERS"])
    return table(["#", "layer", "phase", "predicted op", "shape", "bytes", "ranks", "phase", "measured op", "shape",
                  "bytes", "ranks", ""], rows), differ


def format_ranks(predicted: dict[int, list[CommOp]], measured: dict[int, list[tuple]], *, counted: bool,
                 label) -> tuple[str, int]:
    """Every rank's comparison: a table for the first rank of each distinct prediction (and for
    any that differs), a line for the others; returns the text and the count of rows that differ."""
    lines, shown, mismatches = [], [], 0
    for rank in sorted(measured):
        text, differ = (counted_table if counted else ordered_table)(predicted[rank], measured[rank])
        mismatches += differ
        expected = [record_key(op) for op in predicted[rank]]
        if differ or expected not in shown:
            shown.append(expected)
            lines += ["", f"{label(rank)}:", text]
        else:
            lines.append(f"{label(rank)}: {len(measured[rank])} collectives, as an earlier rank's: all agree")
    n, p = sum(map(len, measured.values())), sum(map(len, predicted.values()))
    lines.append(f"measured {n} collectives on {len(measured)} ranks, predicted {p}: "
                 + ("all agree" if not mismatches else f"{mismatches} {'kinds' if counted else 'rows'} differ"))
    return "\n".join(lines), mismatches
