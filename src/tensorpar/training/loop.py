"""The training loop behind ``tensorpar train``: TP x DP GPT training on one rank.

:func:`train` runs on every rank of an initialized world (``torchrun``, the ``--nproc``
launcher, or a test's process group). Each step: this DP rank's micro-batches (the same on
every TP rank of the group), forward under autocast when ``--dtype bf16`` (the weights stay
fp32 and are the optimizer's master copy), backward with the DP all-reduces launched bucket by
bucket as gradients appear (with ``--fsdp``: FSDP2's reduce-scatters, see
:mod:`tensorpar.fsdp`), SP grads summed over TP, TP-aware clipping, AdamW, then metrics,
evaluation and checkpoints as asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm, invariant, parallel_state as ps
from .. import grads as tp_grads
from ..comm_model import calibrate_overlap
from ..errors import UsageError
from ..fsdp import ShardedGradSync, bytes_per_rank, fully_shard
from ..models.gpt import GPT, GPTConfig
from ..random import model_parallel_manual_seed
from . import checkpoint, rundir
from .data import BatchSampler, load_corpus
from .progress import Progress
from .resume import RUN_SETTINGS, continue_settings, data_path, resume_header
from .schema import PARAMS_DTYPES

VAL_FRACTION = 0.05
DEFAULT_SEQ_LEN = 128
# GPTConfig fields that only change how the model runs, not its weights: free to differ on resume.
RUNTIME_FIELDS = frozenset({"sequence_parallel", "recompute", "distribute_saved_activations",
                            "gradient_accumulation_fusion", "dropout", "attention_dropout", "params_dtype",
                            "overlap", "interleave", "tp_invariant"})
# CLI flag -> GPTConfig field, for the model-shape overrides.
MODEL_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads",
               "ffn_hidden": "ffn_hidden_size", "vocab": "vocab_size", "norm": "norm",
               "activation": "activation", "position_embedding": "position_embedding",
               "kv_heads": "num_query_groups", "rope_theta": "rope_theta"}


class TrainingDiverged(FloatingPointError):
    """The loss stopped being a finite number."""


class ConfigMismatch(UsageError):
    """The requested model differs from a checkpoint's; the message names the fields."""


def config_to_json(config: GPTConfig) -> dict:
    data = dataclasses.asdict(config)
    data["params_dtype"] = str(config.params_dtype).removeprefix("torch.")
    return data


def config_from_json(data: dict) -> GPTConfig:
    data = dict(data)
    data["params_dtype"] = PARAMS_DTYPES[data.get("params_dtype", "float32")]
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigMismatch(f"checkpoint config has fields this tensorpar does not know: {unknown}")
    return GPTConfig(**data)


# Preset fields whose GPTConfig default derives from another field: they follow an override of it.
DERIVED_FIELDS = {"ffn_hidden_size": "hidden_size", "num_query_groups": "num_heads", "qkv_bias": "bias"}


def _preset_fields(name: str, overridden) -> dict:
    """A preset's GPTConfig fields, less those derived from a field in ``overridden``."""
    fields = dataclasses.asdict(GPTConfig.preset(name))
    return {k: v for k, v in fields.items() if DERIVED_FIELDS.get(k) not in overridden}


def requested_fields(args) -> dict:
    """Shape fields of GPTConfig the command line asks for explicitly (preset fields included)."""
    explicit = {MODEL_FLAGS[flag]: getattr(args, flag) for flag in MODEL_FLAGS
                if getattr(args, flag, None) is not None}
    fields = {}
    if args.model is not None:
        fields.update(_preset_fields(args.model, explicit))
        fields.pop("vocab_size")
    fields.update(explicit)
    # max_seq_len comes from --seq-len (fresh runs) and may exceed the length trained on.
    return {k: v for k, v in fields.items() if k not in RUNTIME_FIELDS and k != "max_seq_len"}


def build_config(args, *, vocab_size: int, saved: dict | None, origin: str = "the checkpoint") -> GPTConfig:
    """The model config: ``saved`` (the resumed checkpoint's, or the ``--init-from-hf``
    model's, named by ``origin``) if given, else preset + overrides.

    With ``saved``, every explicitly requested shape field must match it.
    """
    requested = requested_fields(args)
    if requested.get("vocab_size", vocab_size) < vocab_size:
        raise ConfigMismatch(f"--vocab {requested['vocab_size']} is smaller than the data's vocabulary "
                             f"({vocab_size} token ids)")
    runtime = dict(sequence_parallel=args.sp, recompute=args.recompute, dropout=args.dropout,
                   gradient_accumulation_fusion=args.grad_fusion, overlap=args.overlap, interleave=args.interleave,
                   tp_invariant=args.tp_invariant)
    if saved is None:
        base = {k: v for k, v in _preset_fields(args.model or "tiny", requested).items()
                if k not in RUNTIME_FIELDS}
        base["max_seq_len"] = args.seq_len or (base["max_seq_len"] if args.model else DEFAULT_SEQ_LEN)
        return _config(**{**base, "vocab_size": vocab_size, **requested, **runtime})
    config = config_from_json(saved)
    if vocab_size > config.vocab_size:
        raise ConfigMismatch(f"the data has token ids up to {vocab_size - 1}, beyond {origin}'s "
                             f"vocab_size {config.vocab_size}")
    mismatched = [f"{name}: checkpoint {getattr(config, name)!r}, requested {value!r}"
                  for name, value in sorted(requested.items()) if getattr(config, name) != value]
    if mismatched:
        raise ConfigMismatch(f"{origin}'s model config differs from the one requested: "
                             + "; ".join(mismatched))
    try:
        return dataclasses.replace(config, **runtime)
    except ValueError as exc:
        raise UsageError(f"invalid model: {exc}") from exc


def _config(**fields) -> GPTConfig:
    """A fresh run's GPTConfig; its complaints name the flags."""
    hidden, heads = fields["hidden_size"], fields["num_heads"]
    if hidden % heads:
        raise UsageError(f"the hidden size {hidden} (--hidden) is not divisible by the {heads} attention "
                         "heads (--heads)")
    kv_heads = fields.get("num_query_groups")
    if kv_heads is not None and heads % kv_heads:
        raise UsageError(f"the {heads} attention heads (--heads) are not a multiple of the {kv_heads} key/value "
                         "heads (--kv-heads)")
    try:
        return GPTConfig(**fields)
    except ValueError as exc:
        raise UsageError(f"invalid model: {exc}") from exc


DEFAULT_SCHEDULE = {"lr": 3e-3, "warmup": 30}
MIN_LR_FRACTION = 0.1  # --min-lr, unless given, is this fraction of --lr
DEFAULT_MICRO_BATCH = 16


def settle_run(args, *, meta: dict | None, dp_size: int) -> None:
    """Fill in the run's schedule and batch from the resumed run (``meta``) or the defaults; check them.

    ``--steps`` is the run's total, so a resumed run must still have steps to go. The learning
    rate schedule (``--lr``, ``--min-lr``, ``--warmup``, ``--lr-decay-steps``) is the resumed
    run's unless given; a fresh run decays over ``--steps``. The global batch (sequences per
    optimizer step) and the micro-batch are the resumed run's unless given, and gradient
    accumulation is what makes the global batch at this DP size. Idempotent: the ranks settle
    again what the command line settled.
    """
    start = meta["step"] if meta else 0
    if args.steps <= start:
        raise UsageError(f"--steps {args.steps} is the run's total, and the checkpoint is already at step "
                         f"{start}: pass --steps above {start} to train further")
    saved = (meta or {}).get("schedule", {})
    if args.min_lr is None and args.lr is None:  # a new --lr brings its own floor
        args.min_lr = saved.get("min_lr")
    for name, default in DEFAULT_SCHEDULE.items():
        if getattr(args, name) is None:
            setattr(args, name, saved.get(name, default))
    if args.min_lr is None:
        args.min_lr = args.lr * MIN_LR_FRACTION
    if args.lr_decay_steps is None:
        args.lr_decay_steps = saved.get("decay_steps", saved.get("steps", args.steps))
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}")

    micro = args.micro_batch or (meta or {}).get("micro_batch", DEFAULT_MICRO_BATCH)
    batch = args.global_batch or (meta or {}).get("global_batch") or micro * (args.grad_accum or 1) * dp_size
    what = "--global-batch" if args.global_batch else "the resumed run's global batch"
    if batch % dp_size:
        raise UsageError(f"{what} {batch} cannot be split evenly over {dp_size} data-parallel ranks: "
                         f"choose --nproc/--tp so that the DP size divides {batch}")
    per_rank = batch // dp_size
    if args.micro_batch is None:  # the largest that fits, up to the default
        args.micro_batch = max(d for d in range(1, min(micro, per_rank) + 1) if per_rank % d == 0)
    elif per_rank % args.micro_batch:
        raise UsageError(f"{what} {batch} over {dp_size} data-parallel ranks is {per_rank} sequences "
                         f"per rank, not a multiple of --micro-batch {args.micro_batch}: choose a "
                         f"--micro-batch dividing {per_rank}")
    if args.interleave > args.micro_batch:
        raise UsageError(f"--interleave {args.interleave} splits each micro-batch into {args.interleave} parts, but "
                         f"--micro-batch is {args.micro_batch}: choose a --micro-batch of at least {args.interleave}")
    accum = batch // (dp_size * args.micro_batch)
    if args.grad_accum is not None and args.grad_accum != accum:
        raise UsageError(f"--grad-accum {args.grad_accum} x --micro-batch {args.micro_batch} x {dp_size} "
                         f"data-parallel ranks is {args.grad_accum * args.micro_batch * dp_size} sequences per "
                         f"step, not {what} {batch}: leave --grad-accum out to adapt it")
    args.global_batch, args.grad_accum = batch, accum


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def hf_init_config(directory: str) -> dict:
    """The GPT config (as JSON) of the Hugging Face model directory ``--init-from-hf`` names,
    once its config.json and safetensors headers agree (nothing built, nothing run or fetched)."""
    import importlib.util

    from ..models.hf_files import check_hf_dir

    path = Path(directory)
    if (path / checkpoint.LATEST).is_file() or (path / checkpoint.MANIFEST).is_file():
        raise UsageError(f"--init-from-hf {directory} is a tensorpar run, not a Hugging Face model: use --resume "
                         f"{directory} to continue it, or --init-from {directory} for its weights only")
    if importlib.util.find_spec("safetensors") is None:
        raise UsageError("--init-from-hf needs safetensors: pip install 'tensorpar[hf]'")
    try:
        return config_to_json(check_hf_dir(directory))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--init-from-hf: {exc}") from None


def resolve_tokenizer(args, meta: dict | None) -> None:
    """``args.tokenizer``: ``--tokenizer``, else that of the run ``meta`` describes (resumed or
    ``--init-from``), else the ``--init-from-hf`` directory's when it has one (as an absolute
    path), else None (byte tokens for text)."""
    from .tokenizer import has_tokenizer

    if args.tokenizer is None and meta is not None and meta.get("tokenizer") not in (None, "bytes"):
        args.tokenizer = meta["tokenizer"]
    if args.tokenizer is None and args.init_from_hf is not None and has_tokenizer(args.init_from_hf):
        args.tokenizer = args.init_from_hf
    if args.tokenizer is not None:
        args.tokenizer = str(Path(args.tokenizer).resolve())


def default_seq_len(args, config: GPTConfig) -> int:
    """``--seq-len``, else the model's max_seq_len (a Hugging Face model's, capped at 128)."""
    if args.seq_len is not None:
        return args.seq_len
    return min(config.max_seq_len, DEFAULT_SEQ_LEN) if args.init_from_hf else config.max_seq_len


def check_fits(config: GPTConfig, *, tp: int, seq_len: int) -> None:
    """What TP needs of the model (a query head per rank), and a sequence the model's positions cover."""
    if config.num_heads < tp:
        raise UsageError(f"the model's {config.num_heads} attention heads are fewer than --tp {tp}: every rank "
                         "needs a query head")
    if seq_len > config.max_seq_len:
        raise UsageError(f"--seq-len {seq_len} is longer than the model's max_seq_len {config.max_seq_len}")
    if config.tp_invariant:
        try:
            invariant.check_gpt_sizes(config, tp_size=tp, seq_len=seq_len)
        except ValueError as exc:
            raise UsageError(f"--tp-invariant: {exc}") from None


def count_parameters(model: GPT) -> int:
    """Parameters of the unpadded TP=1 model: the same number at every TP size."""
    tp = comm.group_size(model.tp_group)
    total = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters())
    padding = model.padded_vocab_size - model.config.vocab_size
    heads = 1 if model.config.tie_word_embeddings else 2  # the embedding, and an untied LM head
    return total - padding * model.config.hidden_size * heads


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # Decay matrices only; biases and norm weights are 1-D.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _autocast(dtype: str, device: torch.device):
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def _read_back(pending, result: RunResult, progress: Progress, *, tokens_per_s: float, log: bool) -> None:
    """Read the pending steps' losses and grad norms back in one transfer; record and report them."""
    values = torch.stack([torch.stack([loss, norm.double()]) for _, _, loss, norm in pending]).tolist()
    for i, ((step, lr, _, _), (loss, grad_norm)) in enumerate(zip(pending, values)):
        if not math.isfinite(loss):
            raise TrainingDiverged(f"the loss became {loss} at step {step} (learning rate {lr:.3g}): "
                                   "try a lower --lr")
        result.losses[step] = loss
        progress.step(step=step, loss=loss, lr=lr, tokens_per_s=tokens_per_s, grad_norm=grad_norm,
                      log=log and i == len(pending) - 1)


@torch.no_grad()
def evaluate(model, sampler: BatchSampler, *, iters: int, dtype: str, device, dp_group) -> float:
    """Mean validation loss over ``iters`` fixed batches, averaged over DP."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(iters):
        (tokens, labels), = sampler.micro_batches(i)
        with _autocast(dtype, device):
            total += model(tokens.to(device), labels.to(device)).double()
    model.train()
    comm.all_reduce(total, dp_group)
    return float(total) / (iters * comm.group_size(dp_group))


@dataclasses.dataclass
class RunResult:
    """What :func:`train` reports: per-step mean losses, validation losses, the last checkpoint."""

    losses: dict[int, float]
    val_losses: dict[int, float]
    checkpoint: str | None
    tokens_per_s: float
    config: dict
    stopped_by: str | None = None  # "SIGTERM" when preempted (after a checkpoint)


def _save(out: Path, step: int, *, model, optimizer, config, args, tokens_seen: int, sizes, hf_tokenizer) -> str:
    """Checkpoint ``step``; a Hugging Face tokenizer goes into it, so the run needs nothing outside it."""
    meta = {"step": step, "tokens_seen": tokens_seen, "steps": args.steps, "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
            "schedule": {"lr": args.lr, "min_lr": args.min_lr, "warmup": args.warmup,
                         "decay_steps": args.lr_decay_steps},
            "data": {"position": step, "seed": args.seed, "source": args.data or "embedded"},
            "world": {"tp": sizes[0], "dp": sizes[1]}, "dtype": args.dtype,
            "tokenizer": checkpoint.TOKENIZER if hf_tokenizer is not None else args.tokenizer,
            "settings": {**{name: getattr(args, name) for name in RUN_SETTINGS}, "data": data_path(args.data)}}
    path = checkpoint.save(out, step, model=model, optimizer=optimizer, config=config_to_json(config),
                           meta=meta, tp_group=ps.get_tensor_model_parallel_group(),
                           write_extra=None if hf_tokenizer is None
                           else lambda d: hf_tokenizer.save_pretrained(str(d / checkpoint.TOKENIZER)))
    return str(path)


class _Signals:
    """SIGTERM asks to stop after the current step, with a checkpoint; SIGINT stops at once.

    Handlers are installed only in the main thread (Python's rule) and restored on exit.
    """

    def __init__(self) -> None:
        self.term = self.interrupted = False
        self._previous = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_term),
                              signal.SIGINT: signal.signal(signal.SIGINT, self._on_int)}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_term(self, signum, frame) -> None:
        self.term = True

    def _on_int(self, signum, frame) -> None:
        if not self.interrupted:  # a launcher forwarding the same Ctrl-C must not interrupt the exit
            self.interrupted = True
            raise KeyboardInterrupt


def _run_tokenizer(tokenizer: str | None):
    """The Hugging Face tokenizer a run's checkpoints carry (None for byte tokens, or token files without one)."""
    from .tokenizer import has_tokenizer, load_tokenizer

    if tokenizer in (None, "bytes") or not has_tokenizer(tokenizer):
        return None
    return load_tokenizer(tokenizer, flag="the run's tokenizer")


def _say(message: str) -> None:
    print(f"tensorpar train: {message}", file=sys.stderr, flush=True)


def _resume_hint(out: Path | None) -> str:
    try:
        last = checkpoint.latest_step_dir(out) if out is not None else None
    except checkpoint.CheckpointError:
        last = None
    if last is None:
        return "no checkpoint was written"
    return f"the last checkpoint is {last} (continue with --resume {out})"


def train(args) -> RunResult:
    """Train on every rank of the current world (initializing tensorpar's groups), per ``args``.

    Rank 0 holds the output directory's lock for the whole run. An error on any rank propagates
    at once, nothing on that path waits for a peer; the peers fail fast once this process exits.
    """
    ps.initialize_model_parallel(args.tp, timeout=args.timeout)
    lock, signals = None, _Signals()
    try:
        with signals:
            lock = _claim_out(args)
            result = _train(args, signals)
    except BaseException:
        # The groups stay up: tearing them down here would break the peers' pending collectives
        # at once, and their errors could be reported before this one. Exiting frees them.
        if not signals.interrupted:
            raise
        if dist.get_rank() == 0:
            _say(f"interrupted (SIGINT); {_resume_hint(Path(args.out) if args.out else None)}")
        raise SystemExit(130) from None
    finally:
        if lock is not None:
            lock.release()
    dist.barrier()  # nobody tears down gloo while a peer still talks to it
    ps.destroy_model_parallel()
    return result


def _claim_out(args) -> rundir.RunLock | None:
    """Rank 0 locks ``args.out`` (refused on every rank if it cannot)."""
    if not args.out:
        return None
    outcome = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = rundir.claim(args.out, resume=bool(args.resume), overwrite=getattr(args, "overwrite", False),
                                      resume_from=checkpoint.resolve(args.resume) if args.resume else None)
        except (rundir.RunDirError, checkpoint.CheckpointError, OSError) as exc:
            outcome[1] = str(exc)
    if dist.get_world_size() > 1:
        shared = [outcome[1]]
        dist.broadcast_object_list(shared, src=0)
        outcome[1] = shared[0]
    if outcome[1] is not None:
        raise rundir.RunDirError(outcome[1])
    if outcome[0] is not None and outcome[0].set_aside is not None:
        what = "the newer checkpoints are" if args.resume else "the previous run is"
        _say(f"--overwrite: {what} kept in {outcome[0].set_aside} until this run's first checkpoint is written")
    return outcome[0]


def _control_group():
    """The world as a CPU (gloo) group, so agreeing on a flag never waits for the device."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _stop_requested(signals: _Signals, control_group) -> bool:
    """Whether any rank got SIGTERM: all ranks then stop after the same step."""
    flag = torch.tensor([1 if signals.term else 0], dtype=torch.int32)
    comm.all_reduce(flag, control_group, op="max")
    return bool(flag.item())


def _train(args, signals: _Signals) -> RunResult:
    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    tp_size, dp_size, dp_rank = (comm.group_size(tp_group), comm.group_size(dp_group),
                                 comm.group_rank(dp_group))
    device = ps.default_device()
    is_rank0 = dist.get_rank() == 0
    resumed = checkpoint.open_checkpoint(args.resume) if args.resume else None
    init = checkpoint.open_checkpoint(args.init_from) if args.init_from else None
    started_from = resumed or init
    continue_settings(args, resumed[2] if resumed else None)
    resolve_tokenizer(args, started_from[2] if started_from else None)
    corpus = load_corpus(args.data, tokenizer=args.tokenizer)
    args.tokenizer = corpus.tokenizer
    hf_tokenizer = _run_tokenizer(args.tokenizer)
    if args.init_from_hf:
        config = build_config(args, vocab_size=corpus.vocab_size, saved=hf_init_config(args.init_from_hf),
                              origin=f"--init-from-hf {args.init_from_hf}")
    elif init:
        config = build_config(args, vocab_size=corpus.vocab_size, saved=init[1], origin=f"--init-from {args.init_from}")
    else:
        config = build_config(args, vocab_size=corpus.vocab_size, saved=resumed[1] if resumed else None)
    seq_len = args.seq_len = default_seq_len(args, config)
    check_fits(config, tp=tp_size, seq_len=seq_len)
    settle_run(args, meta=resumed[2] if resumed else None, dp_size=dp_size)
    train_tokens, val_tokens = corpus.split(val_fraction=VAL_FRACTION, seq_len=seq_len)

    model_parallel_manual_seed(args.seed)
    model = GPT(config, device=device)
    if args.init_from_hf:
        from ..models.hf import load_weights

        try:
            load_weights(model, args.init_from_hf)
        except ValueError as exc:  # NaN/inf weights: only reading them can tell
            raise UsageError(f"--init-from-hf: {exc}") from None
    elif init:
        checkpoint.load(init[0], model=model, optimizer=None, tp_group=tp_group, restore_rng=False)
    fsdp = getattr(args, "fsdp", False)
    if fsdp:
        fully_shard(model, dp_group=dp_group)
    optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr,
                                  betas=(0.9, 0.95), eps=1e-8)
    # TP-invariant mode: the same reductions, in orders that do not depend on the TP size.
    grads = invariant if config.tp_invariant else tp_grads
    reducer = ShardedGradSync(model) if fsdp else grads.DataParallelGradReducer(model.parameters(), dp_group=dp_group)
    # Training steps run the compiled model; evaluation and checkpoints use the module itself.
    step_model = torch.compile(model) if getattr(args, "compile", False) else model
    params = list(model.parameters())
    start = 0
    out = Path(args.out) if args.out else None
    if resumed:
        ckpt, _, meta = resumed
        same_world = meta["world"] == {"tp": tp_size, "dp": dp_size}
        checkpoint.load(ckpt, model=model, optimizer=optimizer, tp_group=tp_group, restore_rng=same_world)
        start = meta["step"]
        if not same_world:
            # Another layout has other ranks: continue with fresh, still reproducible, streams.
            model_parallel_manual_seed(args.seed + start)

    with _autocast(args.dtype, device):  # overlap="auto": measured at the dtype the layers compute in
        calibrate_overlap(model, tokens=args.micro_batch * seq_len)
    sampler = BatchSampler(train_tokens, seq_len=seq_len, micro_batch=args.micro_batch,
                           grad_accum=args.grad_accum, dp_rank=dp_rank, dp_size=dp_size, seed=args.seed)
    val_sampler = BatchSampler(val_tokens, seq_len=seq_len, micro_batch=args.micro_batch, grad_accum=1,
                               dp_rank=dp_rank, dp_size=dp_size, seed=args.seed, stream=1)
    tokens_per_step = args.global_batch * seq_len
    if is_rank0:
        print(f"tensorpar train: {count_parameters(model) / 1e6:.2f}M parameters, TP={tp_size} DP={dp_size}, "
              f"global batch {args.global_batch} sequences ({args.micro_batch} per micro-batch x {dp_size} DP "
              f"x {args.grad_accum} accumulation) = {tokens_per_step:,} tokens/step, data: {corpus.source}",
              flush=True)
        memory = ", ".join(f"{what} {n / 2**20:.2f} MiB" for what, n in bytes_per_rank(model).items())
        print(f"tensorpar train: per rank {memory}" + (f" (FSDP: 1/{dp_size} of each TP shard)" if fsdp else ""),
              flush=True)
        if resumed:
            header, note = resume_header(args, resumed[2], ckpt=resumed[0], tp=tp_size, dp=dp_size,
                                         data=corpus.source)
            print(f"tensorpar train: {header}", flush=True)
            if note:
                _say(note)
    progress = Progress(out=out, total_steps=args.steps, first_step=start, enabled=is_rank0,
                        bar=not args.no_progress, tensorboard=args.tensorboard)
    result = RunResult({}, {}, None, 0.0, config_to_json(config))
    measured_tokens, measured_time = 0, 0.0
    # Steps whose loss and grad norm stay on the device until the next log line: reading them
    # back every step would make the CPU wait for each step before queueing the next.
    pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []
    interval_began = time.perf_counter()
    control_group = _control_group()
    try:
        for step in range(start, args.steps):
            lr = lr_at(step, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, total=args.lr_decay_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            reducer.zero_grad()
            batches = sampler.micro_batches(step)
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for k, (tokens, labels) in enumerate(batches):
                reducer.sync = k == len(batches) - 1
                with _autocast(args.dtype, device):
                    loss = step_model(tokens.to(device), labels.to(device))
                (loss / len(batches)).backward()
                loss_sum += loss.detach().double()
            reducer.finish()
            if config.sequence_parallel:
                grads.allreduce_sequence_parallel_grads(model)
            grad_norm = (grads.clip_grad_norm_(params, args.clip_grad, dp_group=dp_group) if args.clip_grad > 0
                         else grads.get_grad_norm(params, dp_group=dp_group))
            optimizer.step()
            comm.all_reduce(loss_sum, dp_group)
            done = step + 1
            pending.append((done, lr, loss_sum / (len(batches) * dp_size), grad_norm))
            log = done % args.log_every == 0 or done == args.steps
            evaluating = bool(args.eval_every) and (done % args.eval_every == 0 or done == args.steps)
            stop = _stop_requested(signals, control_group)
            saving = out is not None and bool(stop or (args.save_every and done % args.save_every == 0)
                                              or done == args.steps)
            # Also after the first step, whose one-off warm-up costs stay out of the measured rate.
            if log or evaluating or saving or stop or done == start + 1:
                elapsed = time.perf_counter() - interval_began
                _read_back(pending, result, progress, tokens_per_s=tokens_per_step * len(pending) / elapsed, log=log)
                if done > start + 1:
                    measured_tokens, measured_time = measured_tokens + tokens_per_step * len(pending), \
                        measured_time + elapsed
                pending.clear()
                interval_began = time.perf_counter()
            if evaluating:
                val = evaluate(model, val_sampler, iters=args.eval_iters, dtype=args.dtype,
                               device=device, dp_group=dp_group)
                result.val_losses[done] = val
                progress.eval(step=done, val_loss=val)
            if saving:
                result.checkpoint = _save(out, done, model=model, optimizer=optimizer, config=config,
                                          args=args, tokens_seen=done * tokens_per_step,
                                          sizes=(tp_size, dp_size), hf_tokenizer=hf_tokenizer)
                if getattr(args, "overwrite", False) and is_rank0:
                    rundir.remove_set_aside(out)  # the new run's first checkpoint is safely written
            if stop:
                result.stopped_by = "SIGTERM"
                if is_rank0:
                    where = f"checkpoint {result.checkpoint}" if result.checkpoint else "no --out, no checkpoint"
                    _say(f"stopped by SIGTERM after step {done}; {where}"
                         + (f" (continue with --resume {out})" if result.checkpoint else ""))
                break
        progress.plot()
        if control_group is not None:
            dist.destroy_process_group(control_group)
    finally:
        progress.close()
        reducer.remove_hooks()
    result.tokens_per_s = measured_tokens / measured_time if measured_time else 0.0
    return result
