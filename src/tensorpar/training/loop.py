"""The training loop behind ``tensorpar train``: TP x DP GPT training on one rank.

:func:`train` runs on every rank of an initialized world (``torchrun``, the ``--nproc``
launcher, or a test's process group). Each step: this DP rank's micro-batches (the same on
every TP rank of the group), forward under autocast when ``--dtype bf16`` (the weights stay
fp32 and are the optimizer's master copy), backward with the DP all-reduces launched bucket by
bucket as gradients appear, SP grads summed over TP, TP-aware clipping, AdamW, then metrics,
evaluation and checkpoints as asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm, parallel_state as ps
from ..errors import UsageError
from ..grads import DataParallelGradReducer, allreduce_sequence_parallel_grads, clip_grad_norm_, get_grad_norm
from ..models.gpt import GPT, GPTConfig
from ..random import model_parallel_manual_seed
from . import checkpoint
from .data import BatchSampler, load_corpus
from .progress import Progress

VAL_FRACTION = 0.05
DEFAULT_SEQ_LEN = 128
# GPTConfig fields that only change how the model runs, not its weights: free to differ on resume.
RUNTIME_FIELDS = frozenset({"sequence_parallel", "recompute", "distribute_saved_activations",
                            "gradient_accumulation_fusion", "dropout", "attention_dropout", "params_dtype"})
# CLI flag -> GPTConfig field, for the model-shape overrides.
MODEL_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads",
               "ffn_hidden": "ffn_hidden_size", "vocab": "vocab_size", "norm": "norm",
               "activation": "activation", "position_embedding": "position_embedding"}


class ConfigMismatch(UsageError):
    """The requested model differs from a checkpoint's; the message names the fields."""


def config_to_json(config: GPTConfig) -> dict:
    data = dataclasses.asdict(config)
    data["params_dtype"] = str(config.params_dtype).removeprefix("torch.")
    return data


def config_from_json(data: dict) -> GPTConfig:
    data = dict(data)
    data["params_dtype"] = getattr(torch, data.get("params_dtype", "float32"))
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigMismatch(f"checkpoint config has fields this tensorpar does not know: {unknown}")
    return GPTConfig(**data)


def requested_fields(args) -> dict:
    """Shape fields of GPTConfig the command line asks for explicitly (preset fields included)."""
    fields = {}
    if args.model is not None:
        fields.update(dataclasses.asdict(GPTConfig.preset(args.model)))
        fields.pop("vocab_size")
        if args.hidden is not None and args.ffn_hidden is None:
            fields.pop("ffn_hidden_size")  # the preset's is 4 x its own width
    fields.update({MODEL_FLAGS[flag]: getattr(args, flag) for flag in MODEL_FLAGS
                   if getattr(args, flag, None) is not None})
    # max_seq_len comes from --seq-len (fresh runs) and may exceed the length trained on.
    return {k: v for k, v in fields.items() if k not in RUNTIME_FIELDS and k != "max_seq_len"}


def build_config(args, *, vocab_size: int, saved: dict | None) -> GPTConfig:
    """The model config: the checkpoint's (``saved``) when resuming, else preset + overrides.

    When resuming, every explicitly requested shape field must match the checkpoint.
    """
    requested = requested_fields(args)
    if requested.get("vocab_size", vocab_size) < vocab_size:
        raise ConfigMismatch(f"--vocab {requested['vocab_size']} is smaller than the data's vocabulary "
                             f"({vocab_size} token ids)")
    runtime = dict(sequence_parallel=args.sp, recompute=args.recompute, dropout=args.dropout,
                   gradient_accumulation_fusion=args.grad_fusion)
    if saved is None:
        preset = GPTConfig.preset(args.model or "tiny")
        base = {k: v for k, v in dataclasses.asdict(preset).items()
                if k not in RUNTIME_FIELDS and k != "max_seq_len"}
        base["max_seq_len"] = args.seq_len or (preset.max_seq_len if args.model else DEFAULT_SEQ_LEN)
        if "ffn_hidden_size" not in requested and "hidden_size" in requested:
            base.pop("ffn_hidden_size")  # the default (4 x hidden) of the new width
        return GPTConfig(**{**base, "vocab_size": vocab_size, **requested, **runtime})
    config = config_from_json(saved)
    if vocab_size > config.vocab_size:
        raise ConfigMismatch(f"the data has token ids up to {vocab_size - 1}, beyond the checkpoint's "
                             f"vocab_size {config.vocab_size}")
    mismatched = [f"{name}: checkpoint {getattr(config, name)!r}, requested {value!r}"
                  for name, value in sorted(requested.items()) if getattr(config, name) != value]
    if mismatched:
        raise ConfigMismatch("the checkpoint's model config differs from the one requested: "
                             + "; ".join(mismatched))
    return dataclasses.replace(config, **runtime)


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


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


def _save(out: Path, step: int, *, model, optimizer, config, args, tokens_seen: int, sizes) -> str:
    meta = {"step": step, "tokens_seen": tokens_seen,
            "schedule": {"lr": args.lr, "min_lr": args.min_lr, "warmup": args.warmup, "steps": args.steps},
            "data": {"position": step, "seed": args.seed, "source": args.data or "embedded"},
            "world": {"tp": sizes[0], "dp": sizes[1]}, "dtype": args.dtype,
            "tokenizer": args.tokenizer}
    path = checkpoint.save(out, step, model=model, optimizer=optimizer, config=config_to_json(config),
                           meta=meta, tp_group=ps.get_tensor_model_parallel_group())
    return str(path)


def train(args) -> RunResult:
    """Train on every rank of the current world (initializing tensorpar's groups), per ``args``."""
    ps.initialize_model_parallel(args.tp, timeout=args.timeout)
    try:
        return _train(args)
    finally:
        if dist.is_initialized():
            dist.barrier()  # nobody tears down gloo while a peer still talks to it
        ps.destroy_model_parallel()


def _train(args) -> RunResult:
    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    tp_size, dp_size, dp_rank = (comm.group_size(tp_group), comm.group_size(dp_group),
                                 comm.group_rank(dp_group))
    device = ps.default_device()
    is_rank0 = dist.get_rank() == 0
    corpus = load_corpus(args.data)
    args.tokenizer = corpus.tokenizer
    resumed = checkpoint.open_checkpoint(args.resume) if args.resume else None
    config = build_config(args, vocab_size=corpus.vocab_size, saved=resumed[1] if resumed else None)
    seq_len = args.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        raise ConfigMismatch(f"--seq-len {seq_len} is longer than the model's max_seq_len {config.max_seq_len}")
    train_tokens, val_tokens = corpus.split(val_fraction=VAL_FRACTION, seq_len=seq_len)

    model_parallel_manual_seed(args.seed)
    model = GPT(config, device=device)
    optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr,
                                  betas=(0.9, 0.95), eps=1e-8)
    reducer = DataParallelGradReducer(model.parameters(), dp_group=dp_group)
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

    sampler = BatchSampler(train_tokens, seq_len=seq_len, micro_batch=args.micro_batch,
                           grad_accum=args.grad_accum, dp_rank=dp_rank, dp_size=dp_size, seed=args.seed)
    val_sampler = BatchSampler(val_tokens, seq_len=seq_len, micro_batch=args.micro_batch, grad_accum=1,
                               dp_rank=dp_rank, dp_size=dp_size, seed=args.seed, stream=1)
    tokens_per_step = args.micro_batch * args.grad_accum * dp_size * seq_len
    progress = Progress(out=out, total_steps=args.steps, first_step=start, enabled=is_rank0,
                        bar=not args.no_progress)
    result = RunResult({}, {}, None, 0.0, config_to_json(config))
    if is_rank0:
        print(f"tensorpar train: {sum(p.numel() for p in params) * tp_size / 1e6:.2f}M parameters "
              f"(approx.), TP={tp_size} DP={dp_size}, {tokens_per_step} tokens/step, data: {corpus.source}",
              flush=True)
    measured_tokens, measured_time = 0, 0.0
    try:
        for step in range(start, args.steps):
            began = time.perf_counter()
            lr = lr_at(step, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, total=args.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            reducer.zero_grad()
            batches = sampler.micro_batches(step)
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for k, (tokens, labels) in enumerate(batches):
                reducer.sync = k == len(batches) - 1
                with _autocast(args.dtype, device):
                    loss = model(tokens.to(device), labels.to(device))
                (loss / len(batches)).backward()
                loss_sum += loss.detach().double()
            reducer.finish()
            if config.sequence_parallel:
                allreduce_sequence_parallel_grads(model)
            grad_norm = (clip_grad_norm_(params, args.clip_grad) if args.clip_grad > 0
                         else get_grad_norm(params))
            optimizer.step()
            comm.all_reduce(loss_sum, dp_group)
            loss_value = float(loss_sum) / (len(batches) * dp_size)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step + 1}; lower --lr or "
                                         "set --clip-grad")
            elapsed = time.perf_counter() - began
            if step > start:  # the first step includes one-off warm-up costs
                measured_tokens, measured_time = measured_tokens + tokens_per_step, measured_time + elapsed
            done = step + 1
            result.losses[done] = loss_value
            progress.step(step=done, loss=loss_value, lr=lr, tokens_per_s=tokens_per_step / elapsed,
                          grad_norm=float(grad_norm),
                          log=done % args.log_every == 0 or done == args.steps)
            if args.eval_every and (done % args.eval_every == 0 or done == args.steps):
                val = evaluate(model, val_sampler, iters=args.eval_iters, dtype=args.dtype,
                               device=device, dp_group=dp_group)
                result.val_losses[done] = val
                progress.eval(step=done, val_loss=val)
            if out is not None and ((args.save_every and done % args.save_every == 0) or done == args.steps):
                result.checkpoint = _save(out, done, model=model, optimizer=optimizer, config=config,
                                          args=args, tokens_seen=done * tokens_per_step,
                                          sizes=(tp_size, dp_size))
    finally:
        progress.close()
        reducer.remove_hooks()
    result.tokens_per_s = measured_tokens / measured_time if measured_time else 0.0
    return result
