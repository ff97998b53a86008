"""``tensorpar train``, ``tensorpar generate`` and ``tensorpar export``.

Each command runs on a world of processes: under ``torchrun`` it joins the launcher's world
(reading its environment); run directly, ``--nproc N`` starts N local processes through torch's
elastic launcher (what ``torchrun --standalone`` uses), and ``--nproc 1`` runs in this process.
Bad input (flags, sizes, paths) is rejected here, before any process starts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from ..errors import UsageError
from ..launch import launch_local, set_threads

DEFAULT_OUT = "tensorpar-run"


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    return parse


def _add_world_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=_positive(int), default=None,
                        help="local processes to start (default: the GPU count, or 2 on CPU); "
                             "ignored under torchrun, which sets the world")
    parser.add_argument("--tp", type=_positive(int), default=None,
                        help="tensor-parallel size (default: 2 if the world is even, else 1); "
                             "the rest of the world is data parallel")
    parser.add_argument("--timeout", type=_positive(float), default=300.0,
                        help="seconds before a collective that does not complete is an error")


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    _add_world_flags(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=_positive(int), default=600, help="optimizer steps in total")
    run.add_argument("--out", default=None, help=f"output directory (default: {DEFAULT_OUT}, or the "
                     "resumed run's directory): checkpoints, metrics.jsonl, loss.png")
    run.add_argument("--resume", default=None, metavar="CKPT",
                     help="checkpoint to continue from: a step_N directory or an output directory "
                          "(its latest); any TP/DP size")
    run.add_argument("--save-every", type=_non_negative(int), default=0,
                     help="checkpoint every N steps (0: only at the end)")
    run.add_argument("--eval-every", type=_non_negative(int), default=100, help="validate every N steps (0: never)")
    run.add_argument("--eval-iters", type=_positive(int), default=10, help="validation batches per evaluation")
    run.add_argument("--log-every", type=_positive(int), default=10, help="metrics.jsonl row every N steps")
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    data = parser.add_argument_group("data")
    data.add_argument("--data", default=None, metavar="PATH",
                      help="text file, directory of text files, or token file with a .json sidecar "
                           "(default: this Python's standard library source)")
    data.add_argument("--seq-len", type=_positive(int), default=None, help="tokens per sample (default: the model's max_seq_len, 128 for the default model)")
    data.add_argument("--micro-batch", type=_positive(int), default=16, help="samples per DP rank per micro-batch")
    data.add_argument("--grad-accum", type=_positive(int), default=1, help="micro-batches per step")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="size preset: tiny (default), llama-tiny, small "
                       "(GPT-2 124M), medium, large, xl")
    model.add_argument("--layers", type=_positive(int), default=None)
    model.add_argument("--hidden", type=_positive(int), default=None)
    model.add_argument("--heads", type=_positive(int), default=None)
    model.add_argument("--ffn-hidden", type=_positive(int), default=None)
    model.add_argument("--vocab", type=_positive(int), default=None, help="vocabulary size (default: the data's)")
    model.add_argument("--norm", choices=("layernorm", "rmsnorm"), default=None)
    model.add_argument("--activation", choices=("gelu", "gelu_tanh", "swiglu"), default=None)
    model.add_argument("--position-embedding", choices=("learned", "rope"), default=None)
    model.add_argument("--dropout", type=float, default=0.0)
    model.add_argument("--sp", action="store_true", help="sequence parallelism")
    model.add_argument("--recompute", action="store_true", help="recompute each block in backward")
    model.add_argument("--grad-fusion", action="store_true",
                       help="linear layers accumulate weight grads straight into fp32 main_grad")
    model.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                       help="compute dtype (bf16: autocast, fp32 master weights)")
    optim = parser.add_argument_group("optimizer")
    optim.add_argument("--lr", type=_positive(float), default=3e-3, help="peak learning rate")
    optim.add_argument("--min-lr", type=_non_negative(float), default=3e-4, help="learning rate at the end")
    optim.add_argument("--warmup", type=_non_negative(int), default=30, help="linear warmup steps")
    optim.add_argument("--weight-decay", type=_non_negative(float), default=0.1)
    optim.add_argument("--clip-grad", type=_non_negative(float), default=1.0,
                       help="max global grad norm (0: no clipping)")


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """``tensorpar train`` flags as a namespace (what tests and scripts pass to the loop)."""
    parser = argparse.ArgumentParser(prog="tensorpar train")
    add_train_flags(parser)
    return parser.parse_args(argv)


# --- the world of processes ---------------------------------------------------------------

def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _resolve_world(args) -> int:
    """Fill ``args.nproc`` / ``args.tp``; returns the world size (checked against TP)."""
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else (args.nproc or _default_nproc())
    args.nproc = world if not _under_torchrun() else args.nproc
    if args.tp is None:
        args.tp = 2 if world % 2 == 0 else 1
    if world % args.tp:
        where = "the torchrun world size" if _under_torchrun() else "--nproc"
        raise UsageError(f"--tp {args.tp} does not divide {where} {world}")
    return world


def _run_in_world(entry, args, nproc: int) -> dict:
    """Run ``entry(args)`` on every rank; returns {rank: result}."""
    # The subcommand's handler is a closure: keep it out of what the workers unpickle.
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    if _under_torchrun():
        set_threads()
        return {int(os.environ["RANK"]): entry(args)}
    return launch_local(entry, args, nproc=nproc)


# --- train ---------------------------------------------------------------------------------

def _check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".tensorpar-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {out} is not a writable directory ({exc.strerror or exc})") from None


def _check_train_args(args) -> None:
    from ..models.gpt import GPTConfig
    from .checkpoint import CheckpointError, read_json, resolve
    from .data import check_data_path

    if args.model is not None and args.model not in GPTConfig.PRESETS:
        raise UsageError(f"--model {args.model!r} is not a preset; choose from {list(GPTConfig.PRESETS)}")
    heads = args.heads
    if args.resume is not None:
        try:
            ckpt = resolve(args.resume)
            saved = read_json(ckpt)[0]
        except (CheckpointError, OSError, ValueError) as exc:
            raise UsageError(f"--resume {args.resume}: {exc}") from None
        heads = heads or saved.get("num_heads")
        args.out = args.out or str(ckpt.parent)
    heads = heads or GPTConfig.preset(args.model or "tiny").num_heads
    if heads % args.tp:
        raise UsageError(f"the model's {heads} attention heads are not divisible by --tp {args.tp}")
    if args.data is not None:
        check_data_path(args.data)
    args.out = args.out or DEFAULT_OUT
    _check_out(Path(args.out))


def train_entry(args):
    """One rank of ``tensorpar train``."""
    from .loop import train

    return train(args)


def _cmd_train(args) -> int:
    world = _resolve_world(args)
    _check_train_args(args)
    started = datetime.datetime.now()
    results = _run_in_world(train_entry, args, world)
    result = results.get(0)
    if result is not None:
        seconds = (datetime.datetime.now() - started).total_seconds()
        losses = list(result.losses.values())
        summary = f"trained {len(losses)} steps in {seconds:.0f}s"
        if losses:
            summary += f": loss {losses[0]:.3f} -> {losses[-1]:.3f}, {result.tokens_per_s:,.0f} tokens/s"
        if result.val_losses:
            summary += f", validation {list(result.val_losses.values())[-1]:.3f}"
        print(f"{summary}\ncheckpoint {result.checkpoint}; metrics and loss.png in {args.out}", flush=True)
    return 0


# --- generate and export -----------------------------------------------------------------

def generate_entry(args):
    """One rank of ``tensorpar generate``: returns the decoded text (rank 0 prints it)."""
    from .inference import generate

    return generate(args)


def _cmd_generate(args) -> int:
    world = _resolve_world(args)
    results = _run_in_world(generate_entry, args, world)
    if 0 in results:
        print(results[0], flush=True)
    return 0


def export_entry(args):
    from .inference import export_hf

    return export_hf(args)


def _cmd_export(args) -> int:
    args.nproc, args.tp = 1, 1
    path = _run_in_world(export_entry, args, 1)[0]
    print(f"wrote a transformers model to {path}", flush=True)
    return 0


def register(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a TP x DP GPT (default: a small one on an embedded corpus)",
                                  description=_cmd_train.__doc__ or "Train a GPT with tensor and data parallelism.")
    add_train_flags(train)
    train.set_defaults(func=_cmd_train)

    gen = subparsers.add_parser("generate", help="sample text from a checkpoint, at any TP size")
    gen.add_argument("--checkpoint", required=True, help="a step_N directory or an output directory")
    gen.add_argument("--prompt", default="def ", help="text to continue")
    gen.add_argument("--max-new-tokens", type=_positive(int), default=200)
    gen.add_argument("--temperature", type=_non_negative(float), default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=_positive(int), default=40)
    gen.add_argument("--seed", type=int, default=0)
    _add_world_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    export = subparsers.add_parser("export", help="write a checkpoint as a transformers model directory")
    export.add_argument("--checkpoint", required=True, help="a step_N directory or an output directory")
    export.add_argument("--to-hf", required=True, metavar="OUT", help="directory for config.json + model.safetensors")
    export.add_argument("--timeout", type=_positive(float), default=300.0)
    export.set_defaults(func=_cmd_export)
