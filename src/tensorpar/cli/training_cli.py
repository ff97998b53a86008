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
from ..training.run_config import RunConfig
from . import config_file, context_flags, expert_flags, fsdp_flags, pipeline_flags
from .errors import noted_on_signal
from .flag_types import MOST_SEQUENCES, MOST_STEPS, SEED as _SEED, TIMEOUT as _TIMEOUT
from .flag_types import non_negative as _non_negative
from .flag_types import number as _number
from .flag_types import overlap as _overlap
from .flag_types import positive as _positive
from .terminal import for_terminal

DEFAULT_OUT = "tensorpar-run"


def _add_world_flags(parser: argparse.ArgumentParser, *, nproc_default: str = "the GPU count, or 2 on CPU",
                     tp_rest: str = "; the rest of the world is data parallel") -> None:
    parser.add_argument("--nproc", type=_positive(int), default=None,
                        help=f"local processes to start (default: {nproc_default}); "
                             "ignored under torchrun, which sets the world")
    parser.add_argument("--tp", type=_positive(int), default=None,
                        help=f"tensor-parallel size (default: 2 if the world is even, else 1){tp_rest}")
    parser.add_argument("--timeout", type=_TIMEOUT, default=300.0,
                        help="seconds before a collective that does not complete is an error, in [1, 604800)")


_PRESET_HELP = ("model preset (default: tiny): tiny (4 layers, width 128, 4 heads), llama-tiny (tiny with "
                "RMSNorm, SwiGLU and rotary positions), moe-tiny (llama-tiny with 8 experts, 2 per token), small, medium, large, xl (the layer shapes of GPT-2 "
                "small/medium/large/xl; the vocabulary is the data's, 257 byte tokens by default, so they "
                "are smaller than GPT-2's 124M/355M/774M/1.5B parameters)")


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """The ``train`` flags. A resumed run keeps every setting it ran with (data, sequence length,
    schedule, batch, logging, evaluation, ...) unless a flag gives another value; defaults are
    None until then, so that a given value can be told from one left out."""
    _add_world_flags(parser)
    pipeline_flags.add_flags(parser)
    context_flags.add_context_flags(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=_positive(int, most=MOST_STEPS), default=600,
                     help="optimizer steps of the whole run; when resuming, the total to reach, not steps to add")
    run.add_argument("--out", default=None, help=f"output directory (default: {DEFAULT_OUT}, or the "
                     "resumed run's directory): checkpoints, metrics.jsonl, loss.png")
    run.add_argument("--resume", default=None, metavar="CKPT",
                     help="checkpoint to continue from: a step_N directory or an output directory "
                          "(its latest); any TP/DP size. The run keeps every setting it had (data, sequence "
                          "length, schedule, batch, logging, ...) unless a flag gives another value, and says "
                          "so (default: start a new run)")
    fsdp_flags.add_fsdp_flags(run)
    run.add_argument("--overwrite", action="store_true",
                     help="start over in an --out that holds a run: its files are removed once this run's "
                          "first checkpoint is written")
    run.add_argument("--save-every", type=_non_negative(int, most=MOST_STEPS), default=None,
                     help="checkpoint every N steps (0: only at the end; default: at each --eval-every)")
    run.add_argument("--keep-last", type=_non_negative(int, most=MOST_SEQUENCES), default=None,
                     help="remove this run's older checkpoints but the newest N (0: keep all; default: 3); never "
                          "the one OUT/latest names, nor those of earlier runs")
    run.add_argument("--eval-every", type=_non_negative(int, most=MOST_STEPS), default=None,
                     help="validate every N steps (0: never; default: 100)")
    run.add_argument("--eval-iters", type=_positive(int, most=MOST_SEQUENCES), default=None,
                     help="validation batches per evaluation, at most the validation split's (default: 10)")
    run.add_argument("--log-every", type=_positive(int, most=MOST_STEPS), default=None,
                     help="metrics.jsonl row every N steps, and a log line when the output is not a terminal "
                          "(default: 10)")
    run.add_argument("--seed", type=_SEED, default=None,
                     help="seed of the weights, dropout and batches, in [0, 2^32) (default: 1234)")
    run.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar, also on a terminal")
    run.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                     help="also write the metrics as TensorBoard scalars to OUT/tensorboard (needs tensorboard; "
                          "default: off)")
    run.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=None,
                     help="also log the config and metrics to Weights & Biases from rank 0 (needs wandb; "
                          "WANDB_MODE=offline: on disk only; project: WANDB_PROJECT, else tensorpar; default: off)")
    data = parser.add_argument_group("data")
    data.add_argument("--data", default=None, metavar="PATH",
                      help="text file, directory of text files, or token file with a .json sidecar "
                           "(default: this Python's standard library source); text costs every rank 2 bytes "
                           "per byte: write large corpora once with tensorpar prepare")
    data.add_argument("--tokenizer", default=None, metavar="DIR",
                      help="Hugging Face tokenizer directory to tokenize text --data with (default: the resumed "
                           "run's, else --init-from-hf's when it has one, else byte tokens)")
    data.add_argument("--seq-len", type=_positive(int), default=None,
                      help="tokens per sample (default: the model's max_seq_len, at most 128 with --init-from-hf; "
                           "128 with the default model)")
    data.add_argument("--micro-batch", type=_positive(int, most=MOST_SEQUENCES), default=None,
                      help="sequences per DP rank per micro-batch (default: the resumed run's, else 16)")
    data.add_argument("--global-batch", type=_positive(int, most=MOST_SEQUENCES), default=None,
                      help="sequences per optimizer step over all DP ranks; gradient accumulation makes it up "
                           "(default: the resumed run's, else --micro-batch x DP size x --grad-accum)")
    data.add_argument("--grad-accum", type=_positive(int, most=MOST_SEQUENCES), default=None,
                      help="micro-batches per step (default: what --global-batch needs, else 1)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PRESET", help=_PRESET_HELP)
    model.add_argument("--init-from-hf", default=None, metavar="DIR",
                       help="start from a local Hugging Face model directory (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE; "
                            "config.json + safetensors): its shape and weights, and its tokenizer if it has one "
                            "(default: random initialization)")
    model.add_argument("--init-from", default=None, metavar="CKPT",
                       help="start a new run from a tensorpar checkpoint's weights (a step_N directory or an output "
                            "directory: its latest), at any TP size: its model and tokenizer, with a fresh optimizer "
                            "and schedule from step 0 (to continue that run instead: --resume; default: random initialization)")
    model.add_argument("--layers", type=_positive(int), default=None, help="transformer layers (default: the preset's)")
    model.add_argument("--hidden", type=_positive(int), default=None, help="hidden size (default: the preset's)")
    model.add_argument("--heads", type=_positive(int), default=None,
                       help="attention heads, at least --tp (default: the preset's)")
    model.add_argument("--kv-heads", type=_positive(int), default=None,
                       help="key/value heads (grouped-query attention), dividing --heads; any number against "
                            "--tp: fewer are replicated (default: --heads)")
    model.add_argument("--ffn-hidden", type=_positive(int), default=None, help="MLP width, any size (default: 4 x hidden)")
    model.add_argument("--rope-theta", type=_positive(float), default=None,
                       help="rotary base with --position-embedding rope (default: 10000)")
    model.add_argument("--vocab", type=_positive(int), default=None,
                       help="vocabulary size, at least the data's (default: the data's)")
    model.add_argument("--norm", choices=("layernorm", "rmsnorm"), default=None,
                       help="normalization (default: the preset's)")
    model.add_argument("--activation", choices=("gelu", "gelu_tanh", "swiglu"), default=None,
                       help="MLP activation (default: the preset's)")
    model.add_argument("--position-embedding", choices=("learned", "rope"), default=None,
                       help="position encoding (default: the preset's)")
    for flag, what in (("--dropout", "dropout probability, in [0, 1) (default: 0)"), ("--attention-dropout",
                       "dropout probability of the attention weights, in [0, 1) (default: --dropout's)")):
        model.add_argument(flag, type=_number(float, low=0, high=1), default=None, help=what)
    expert_flags.add_expert_flags(model)
    model.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                       help="sequence parallelism (default: off)")
    model.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                       help="recompute each block in backward (default: off)")
    model.add_argument("--overlap", type=_overlap, default=None,
                       help="chunk each TP collective against its GEMM: off, auto or a number of chunks (default: off)")
    model.add_argument("--interleave", type=_positive(int), default=None,
                       help="split each block's micro-batch into this many interleaved parts (2: Domino; default: 1)")
    model.add_argument("--compile", action="store_true",
                       help="torch.compile the model (one graph per micro-batch shape; default: eager)")
    model.add_argument("--tp-invariant", action=argparse.BooleanOptionalAction, default=None,
                       help="bit-identical losses and weights at every TP (--invariant-blocks) and DP size, given "
                            "the global batch and micro-batch (same machine), at extra GEMM launches (default: off)")
    model.add_argument("--invariant-blocks", type=_positive(int), default=None,
                       help="--tp-invariant's fixed blocks, which TP divides (default 8: TP 1, 2, 4, 8; 24: 3 and 6 too)")
    model.add_argument("--grad-fusion", action=argparse.BooleanOptionalAction, default=None,
                       help="linear layers accumulate weight grads straight into fp32 main_grad (default: off)")
    model.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                       help="compute dtype (bf16: autocast, fp32 master weights; default: fp32)")
    optim = parser.add_argument_group("optimizer")
    optim.add_argument("--lr", type=_positive(float), default=None, help="peak learning rate (default: 3e-3)")
    optim.add_argument("--min-lr", type=_non_negative(float), default=None,
                       help="learning rate at the end of the decay (default: a tenth of --lr; a resumed run's own "
                            "unless --lr is given)")
    optim.add_argument("--warmup", type=_non_negative(int, most=MOST_STEPS), default=None,
                       help="linear warmup steps (default: 30)")
    optim.add_argument("--lr-decay-steps", type=_positive(int, most=MOST_STEPS), default=None,
                       help="step at which the cosine decay reaches --min-lr (default: --steps of a new run)")
    optim.add_argument("--weight-decay", type=_non_negative(float), default=None,
                       help="AdamW weight decay (default: 0.1)")
    optim.add_argument("--clip-grad", type=_non_negative(float), default=None,
                       help="max global grad norm (0: no clipping; default: 1)")


def train_parser() -> argparse.ArgumentParser:
    """A parser of the ``tensorpar train`` flags (the settings of a run, as its config.toml holds them)."""
    parser = argparse.ArgumentParser(prog="tensorpar train", allow_abbrev=False)
    add_train_flags(parser)
    return parser


def parse_train_args(argv: list[str]) -> RunConfig:
    """The run ``tensorpar train`` flags describe (what tests and scripts pass to the loop)."""
    return RunConfig.from_flags(train_parser().parse_args(argv))


# --- the world of processes ---------------------------------------------------------------

def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _local_ranks(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if _under_torchrun() else world


def _resolve_world(args) -> int:
    """Fill ``args.nproc`` / ``args.tp``; returns the world size (checked against TP)."""
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else (args.nproc or _default_nproc())
    args.nproc = world if not _under_torchrun() else args.nproc
    where = "the torchrun world size" if _under_torchrun() else "--nproc"
    pipeline_flags.check_world(args, world=world, where=where)
    pp, cp = getattr(args, "pp", 1), getattr(args, "cp", 1)  # train's flags only
    if args.tp is None:
        args.tp = 2 if world // pp % (2 * cp) == 0 else 1
    if args.tp * pp > world:
        raise UsageError(f"--tp {args.tp}" + (f" x --pp {pp}" if pp > 1 else "")
                         + f" needs at least {args.tp * pp} processes; {where} is {world}")
    if world % (args.tp * pp):
        raise UsageError(f"--tp {args.tp}" + (f" x --pp {pp} = {args.tp * pp}" if pp > 1 else "")
                         + f" does not divide {where} {world}")
    if cp > 1:
        context_flags.check_world(args, world, where=where)
    return world


def _run_in_world(entry, args, nproc: int) -> dict:
    """Run ``entry(args)`` on every rank; returns {rank: result}."""
    # The subcommand's handler is a closure: keep it out of what the workers unpickle.
    from .launch import launch_local, set_threads

    if isinstance(args, argparse.Namespace):
        args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    if _under_torchrun():
        set_threads()
        return {int(os.environ["RANK"]): entry(args)}
    return launch_local(entry, args, nproc=nproc)


def _check_paths(args) -> None:
    """Refuse a path flag that names nothing, before the slow imports (checkpoint, transformers)."""
    for name in ("data", "resume", "checkpoint", "tokenizer"):
        path = getattr(args, name, None)
        if path is not None and not os.path.exists(path):
            raise UsageError(f"--{name} {path}: no such file or directory")


# --- train ---------------------------------------------------------------------------------

def _check_writable_dir(out: Path, flag: str) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".tensorpar-write-test-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # never through a planted link
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"{flag} {out} is not a writable directory ({exc.strerror or exc})") from None


def _open_checkpoint(flag: str, path: str) -> tuple[Path, dict, dict]:
    """(directory, config, meta) of a checkpoint the user named, verified; errors name the flag."""
    from ..training.checkpoint_files import read_json, resolve, verify
    from ..training.checkpoint_format import CheckpointError

    try:
        ckpt = resolve(path)
        verify(ckpt)
        return (ckpt, *read_json(ckpt))
    except (CheckpointError, OSError, ValueError) as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _check_train_args(args: RunConfig, world: int, *, print_config: bool) -> None:
    from ..models.config import GPTConfig
    from ..training.data import VAL_FRACTION, inspect_data, train_token_count
    from ..training.memory import check_run_memory
    from ..training.progress import check_wandb
    from ..training.model_config import build_config, check_fits, default_seq_len, hf_init_config
    from ..training.schedule import settle_run
    from ..training.tokenizer import resolve_tokenizer
    from ..training.resume import continue_settings
    from ..training import rundir

    if args.model is not None and args.model not in GPTConfig.PRESETS:
        raise UsageError(f"--model {args.model!r} is not a preset; choose from {list(GPTConfig.PRESETS)}")
    starts = [flag for flag, value in (("--resume", args.resume), ("--init-from", args.init_from),
                                       ("--init-from-hf", args.init_from_hf)) if value is not None]
    if len(starts) > 1:
        raise UsageError(f"{starts[0]} and {starts[1]} both say where the run starts: give one of them (--resume "
                         "continues a run; --init-from and --init-from-hf start a new one from weights)")
    saved = meta = init_meta = ckpt = None
    replicate_given = args.dp_replicate is not None  # before a resumed run's fills it in
    origin = "the checkpoint"
    if args.out is not None and (not args.out or Path(args.out).is_symlink()):
        raise UsageError(f"--out {args.out!r} " + ("names no directory" if not args.out else
                         "is a symbolic link: give the directory it points to") + f" (default: {DEFAULT_OUT})")
    if args.resume is not None:
        ckpt, saved, meta = _open_checkpoint("--resume", args.resume)
        args.out = args.out or str(ckpt.parent)
    if args.init_from is not None:
        _, saved, init_meta = _open_checkpoint("--init-from", args.init_from)
        origin = f"--init-from {args.init_from}"
    if args.init_from_hf is not None:
        saved, origin = hf_init_config(args.init_from_hf), f"--init-from-hf {args.init_from_hf}"
    check_wandb(args.wandb, meta)
    continue_settings(args, meta)
    resolve_tokenizer(args, meta or init_meta)
    local_ranks = _local_ranks(world)
    tokens, vocab_size, source = inspect_data(args.data, tokenizer=args.tokenizer, local_ranks=local_ranks)
    config = build_config(args, vocab_size=vocab_size, saved=saved, origin=origin)
    context_flags.check_context(args, config)
    expert_flags.check_experts(args, config, world=world)
    seq_len, dp = default_seq_len(args, config), world // (args.tp * args.cp * args.pp)
    check_fits(config, tp=args.tp, seq_len=seq_len)
    train_token_count(tokens, val_fraction=VAL_FRACTION, seq_len=seq_len, source=source)
    settle_run(args, meta=meta, dp_size=dp)
    pipeline_flags.check_run(args, config)
    fsdp_flags.check_fsdp(args, config, dp=dp * args.cp, replicate_given=replicate_given)
    # Per PP rank under --pp; CP divides the activations, FSDP shards over DP x CP.
    check_run_memory(args, config, dp=dp, seq_len=seq_len, local_ranks=local_ranks)
    args.out = args.out or DEFAULT_OUT
    if print_config:
        return  # nothing is written
    _check_writable_dir(Path(args.out), "--out")
    if not _under_torchrun():
        # Under torchrun every rank runs this check while rank 0 may already hold the lock and
        # write the run's files; train() makes the same checks on rank 0 for every rank.
        rundir.check(args.out, resume=args.resume is not None, overwrite=args.overwrite, resume_from=ckpt)


def train_entry(args):
    """One rank of ``tensorpar train``."""
    from ..training.loop import train

    return train(args)


def _given_settings(flags: argparse.Namespace) -> list[str]:
    """The settings the command line or ``--config`` set to other than their defaults, before the
    run resolves the rest: what the log's header shows."""
    defaults = vars(train_parser().parse_args([]))
    return sorted(name for name, value in vars(flags).items() if name in defaults and value != defaults[name])


def _cmd_train(flags: argparse.Namespace) -> int:
    _check_paths(flags)
    args = RunConfig.from_flags(flags)
    args.given_settings = _given_settings(flags)
    world = _resolve_world(args)
    _check_train_args(args, world, print_config=flags.print_config)
    from ..training.checkpoint_files import resume_hint

    # What the run directory's config.toml records (rank 0 writes it once it holds the directory).
    args.run_config = config_file.dumps(args, parser=train_parser())
    if flags.print_config:
        print(args.run_config, end="", flush=True)
        return 0
    started = datetime.datetime.now()
    with noted_on_signal(lambda: resume_hint(args.out)):  # the Ctrl-C line says where to continue
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
        shown = "metrics and loss.png" if os.path.exists(os.path.join(args.out, "loss.png")) else "metrics"
        print(f"{summary}\ncheckpoint {result.checkpoint}; {shown} in {args.out}", flush=True)
    return 0


# --- generate and export -----------------------------------------------------------------

def generate_entry(args):
    """One rank of ``tensorpar generate``: returns the decoded text (rank 0 prints it)."""
    from ..training.inference import generate

    return generate(args)


def _fits_one_device(ckpt: Path) -> bool:
    """Whether the checkpoint's tensor files (weights and optimizer state: more than generating
    needs) fit in half the memory free on one device (unknown: no)."""
    import torch

    need = sum(path.stat().st_size for path in ckpt.glob("*.distcp"))
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return False
    return need <= free // 2


def _cmd_generate(args) -> int:
    _check_paths(args)
    from ..training.inference import check_generate

    ckpt, saved, meta = _open_checkpoint("--checkpoint", args.checkpoint)
    if args.nproc is None and args.tp is None and not _under_torchrun() and _fits_one_device(ckpt):
        args.nproc = args.tp = 1  # this process generates at once; starting ranks takes seconds each
    world = _resolve_world(args)
    check_generate(args, saved=saved, meta=meta, local_ranks=_local_ranks(world))
    results = _run_in_world(generate_entry, args, world)
    if 0 in results:
        print(for_terminal(results[0], stream=sys.stdout), flush=True)
    return 0


def export_entry(args):
    from ..training.inference import export_hf

    return export_hf(args)


def _cmd_export(args) -> int:
    _check_paths(args)
    try:
        import safetensors  # noqa: F401  (save_pretrained writes model.safetensors)
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"export --to-hf needs transformers and safetensors ({exc.name} is not installed): "
                         "pip install 'tensorpar[hf]'") from None
    from ..models.hf import hf_config_of
    from ..training.memory import check_inference_memory
    from ..training.model_config import config_from_json

    _, saved, _ = _open_checkpoint("--checkpoint", args.checkpoint)
    check_inference_memory(config_from_json(saved), tp=1, tokens=0, local_ranks=1)
    try:
        hf_config_of(config_from_json(saved))
    except ValueError as exc:
        raise UsageError(f"--checkpoint {args.checkpoint} cannot be exported: {exc}") from None
    out = Path(args.to_hf)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--to-hf {out} is an existing file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"--to-hf {out} is a directory that is not empty; pass --overwrite to write "
                         "config.json and model.safetensors into it")
    _check_writable_dir(out, "--to-hf")
    args.nproc, args.tp = 1, 1
    path, step, context = _run_in_world(export_entry, args, 1)[0]
    print(f"wrote a transformers model to {path}: step {step}, a context of {context} tokens (its generation "
          "stops there: max_length)", flush=True)
    return 0


# --- prepare -------------------------------------------------------------------------------

def _cmd_prepare(args) -> int:
    _check_paths(args)
    from ..training.data import prepare

    out = Path(args.out)
    existing = [p for p in (out, Path(f"{out}.json"), Path(f"{out}.tokenizer")) if p.exists()]
    if existing and not args.overwrite:
        raise UsageError(f"--out {out}: {existing[0]} already exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: the directory {out.parent} does not exist")
    corpus = prepare(args.data, out, tokenizer=args.tokenizer, bpe_vocab=args.bpe_vocab)
    print(f"wrote {corpus.tokens.numel():,} tokens (vocabulary {corpus.vocab_size:,}, tokenizer "
          f"{corpus.tokenizer}) to {out} and {out}.json; train with --data {out}", flush=True)
    return 0


def register(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a TP x DP GPT (default: a small one on an embedded corpus)",
                                  description="Train a GPT with tensor and data parallelism.")
    add_train_flags(train)
    config_file.add_config_flags(train)
    train.set_defaults(func=_cmd_train)

    prep = subparsers.add_parser("prepare", help="tokenize text into the token file --data reads",
                                 description="Tokenize a text file or a directory of text files into a "
                                             "memory-mapped token file (+ .json sidecar) for train --data.")
    prep.add_argument("data", metavar="DATA", help="a text file or a directory of text files")
    prep.add_argument("--out", required=True, metavar="FILE", help="the token file to write (FILE.json beside it)")
    tokens = prep.add_mutually_exclusive_group()
    tokens.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a Hugging Face tokenizer directory (default: byte tokens)")
    tokens.add_argument("--bpe-vocab", type=_number(int, low=257, high=1 << 24), default=None, metavar="N",
                        help="train a byte-level BPE of N tokens on DATA, saved as FILE.tokenizer/ "
                             "(default: none, byte tokens)")
    prep.add_argument("--overwrite", action="store_true", help="replace FILE, FILE.json and FILE.tokenizer/")
    prep.set_defaults(func=_cmd_prepare)

    gen = subparsers.add_parser("generate", help="sample text from a checkpoint, at any TP size",
                                description="Continue a prompt with a trained checkpoint, at any TP size.")
    gen.add_argument("--checkpoint", required=True, help="a step_N directory or an output directory (its latest)")
    gen.add_argument("--prompt", default="def ",
                     help="what to continue: text, for runs whose tokenizer is known (byte tokens, or a Hugging "
                          "Face tokenizer saved with the run); for runs on a token file without one, token ids "
                          "separated by spaces, e.g. \"464 2068 7586\" (default: 'def ')")
    gen.add_argument("--tokenizer", default=None, metavar="DIR",
                     help="Hugging Face tokenizer directory for the prompt and the text (default: the run's, "
                          "which its checkpoints carry)")
    gen.add_argument("--max-new-tokens", type=_number(int, low=0, low_inclusive=False, high=1 << 20), default=200,
                     help="tokens to add, in (0, 1048576)")
    gen.add_argument("--temperature", type=_non_negative(float), default=0.8,
                     help="sampling temperature (0: greedy)")
    gen.add_argument("--top-k", type=_positive(int), default=40, help="sample among the k likeliest tokens")
    gen.add_argument("--seed", type=_SEED, default=0, help="seed of the sampling, in [0, 2^32)")
    _add_world_flags(gen, nproc_default="1 with --tp 1 when the checkpoint's tensor files fit in half the memory "
                                        "free on one device, else the GPU count, or 2 on CPU",
                     tp_rest="; ranks past --tp repeat the same sampling")
    gen.set_defaults(func=_cmd_generate)

    export = subparsers.add_parser("export", help="write a checkpoint as a transformers model directory",
                                   description="Write a checkpoint as a transformers model directory: GPT-2 "
                                               "(layernorm, learned positions, GELU, biases), or Llama/Qwen2 "
                                               "(rmsnorm, SwiGLU, rotary positions).")
    export.add_argument("--checkpoint", required=True, help="a step_N directory or an output directory (its latest)")
    export.add_argument("--to-hf", required=True, metavar="OUT",
                        help="directory to create for config.json + model.safetensors")
    export.add_argument("--overwrite", action="store_true", help="write into OUT even if it is not empty")
    export.add_argument("--timeout", type=_TIMEOUT, default=300.0,
                        help="seconds before a collective that does not complete is an error, in [1, 604800)")
    export.set_defaults(func=_cmd_export)
