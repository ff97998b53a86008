"""The training loop behind ``tensorpar train``: TP x CP x PP x DP GPT training on one rank.

:func:`train` runs on every rank of an initialized world (``torchrun``, the ``--nproc``
launcher, or a test's process group). Each step: this DP rank's micro-batches (the same on
every TP and CP rank of the group; CP ranks run their chunks of each, :mod:`.context_run`; PP
stages run them through the schedule, :mod:`.pipeline_step`), forward under autocast when
``--dtype bf16`` (the weights stay fp32 and are the optimizer's master copy), backward with
the DP all-reduces launched bucket by bucket as gradients appear (with ``--fsdp``: FSDP2's
reduce-scatters, see :mod:`tensorpar.data_parallel.fsdp`), SP grads summed over TP, TP-aware clipping, AdamW, then metrics,
evaluation and checkpoints as asked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed import comm
from .. import parallel_state as ps
from ..data_parallel import grads
from ..planning.communication import calibrate_overlap
from ..errors import UsageError
from ..data_parallel.fsdp import ShardedGradSync, bytes_per_rank, describe as describe_fsdp, fully_shard, shard_group
from ..expert_parallel import set_aux_loss_scale
from ..models.gpt import GPT
from ..tensor_parallel.random import model_parallel_manual_seed
from . import checkpoint, invariant_batches, pipeline_step, rundir
from .checkpoint_files import open_checkpoint, resolve
from .checkpoint_format import TOKENIZER, CheckpointError
from .context_run import ContextLayout
from .data import VAL_FRACTION, BatchSampler, load_corpus
from .evaluation import autocast, evaluate
from .expert_balance import ExpertBalance, experts_words
from .flops import flops_per_token, peak_flops_per_s
from .metrics import Rates, config_block
from .model_config import (build_config, check_fits, config_to_json, count_parameters, default_seq_len, hf_init_config,
                           positions_note)
from .progress import Progress
from .resume import RUN_SETTINGS, check_resumed_data, continue_settings, data_path, resume_header
from .run_config import RunConfig
from .schedule import lr_at, schedule_note, settle_run
from .signals import Signals, control_group, stop_requested
from .tokenizer import has_tokenizer, load_tokenizer, resolve_tokenizer, save_tokenizer

class TrainingDiverged(FloatingPointError):
    """The loss stopped being a finite number."""


@dataclasses.dataclass
class RunResult:
    """What :func:`train` reports: per-step mean losses, validation losses, the last checkpoint."""

    losses: dict[int, float]
    val_losses: dict[int, float]
    checkpoint: str | None
    tokens_per_s: float
    config: dict
    stopped_by: str | None = None  # "SIGTERM" when preempted (after a checkpoint)


def adamw(params, *, device: torch.device, tp_invariant: bool = False, **options) -> torch.optim.AdamW:
    """AdamW as ``tensorpar train`` builds it: torch's fused kernel on CPU and CUDA, foreach elsewhere
    and in the TP-invariant mode.

    Fused is one kernel for all parameters (its step 2.5-4x faster than foreach on CPU, which is
    itself 3.5x faster than the per-parameter loop on FSDP's DTensor shards). On CPU its scalar
    tail loop rounds differently from its vector lanes (AVX-512), so a shard's last elements would
    be updated differently at another TP size; foreach's ops give each element the same bits
    wherever it sits.
    ``adamw(model.parameters(), device=device, lr=1e-4)``
    """
    fused = device.type in ("cpu", "cuda") and not tp_invariant
    return torch.optim.AdamW(params, **options, **({"fused": True} if fused else {"foreach": True}))


def _invariant_threads() -> int:
    """The intra-op threads of every rank of an invariant run on CPU, set here: ``OMP_NUM_THREADS``,
    else 1, never the launcher's share of the cores, which differs between layouts (a TP=1 run gets
    4 times a TP=4 run's): a CPU GEMM's result depends on the threads it splits its sums over."""
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.set_num_threads(threads)
    return threads


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # Decay matrices only; biases and norm weights are 1-D. Expert weights apart: under FSDP the
    # others are DTensors, and one fused step takes one kind.
    experts = [p for p in model.parameters() if getattr(p, "expert_parallel", False)]
    decay = [p for p in model.parameters() if p.dim() >= 2 and not getattr(p, "expert_parallel", False)]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return groups + ([{"params": experts, "weight_decay": weight_decay}] if experts else [])


@torch.no_grad()
def _read_back(pending, result: RunResult, progress: Progress, *, tokens_per_s: float, log: bool) -> None:
    """Read the pending steps' losses and grad norms back in one transfer; record and report them."""
    values = torch.stack([torch.cat([torch.stack([loss, norm.double()]), experts.double()])
                          for _, _, loss, norm, experts in pending]).tolist()
    for i, ((step, lr, *_), (loss, grad_norm, *experts)) in enumerate(zip(pending, values)):
        if not math.isfinite(loss):
            raise TrainingDiverged(f"the loss became {loss} at step {step} (learning rate {lr:.3g}): "
                                   "try a lower --lr")
        result.losses[step] = loss
        progress.step(step=step, loss=loss, lr=lr, tokens_per_s=tokens_per_s, grad_norm=grad_norm,
                      log=log and i == len(pending) - 1,
                      extra=dict(zip(("moe_aux_loss", "moe_imbalance"), experts)) if experts else None)


def _save(out: Path, step: int, *, model, optimizer, config, args, tokens_seen: int, world: dict, hf_tokenizer,
          data_record: dict, ep_group) -> str:
    """Checkpoint ``step``; a Hugging Face tokenizer goes into it, so the run needs nothing outside it."""
    meta = {"step": step, "tokens_seen": tokens_seen, "steps": args.steps, "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
            "schedule": {"lr": args.lr, "min_lr": args.min_lr, "warmup": args.warmup,
                         "decay_steps": args.lr_decay_steps},
            "data": {"position": step, "seed": args.seed, "source": args.data or "embedded", **data_record},
            "world": world, "dtype": args.dtype,
            "tokenizer": TOKENIZER if hf_tokenizer is not None else args.tokenizer,
            "settings": {**{name: getattr(args, name) for name in RUN_SETTINGS}, "data": data_path(args.data)}}
    path = checkpoint.save(out, step, model=model, optimizer=optimizer, config=config_to_json(config),
                           meta=meta, tp_group=ps.get_tensor_model_parallel_group(), ep_group=ep_group,
                           write_extra=None if hf_tokenizer is None
                           else lambda d: save_tokenizer(hf_tokenizer, d / TOKENIZER))
    return str(path)


def _world(*, tp: int, dp: int, pp: int, cp: int, dp_replicate: int = 1, ep: int = 1) -> dict:
    """A checkpoint's ``world``: PP, CP, HSDP's replicas and EP only where they are not 1, as before each."""
    return {"tp": tp, "dp": dp, **({"pp": pp} if pp > 1 else {}), **({"cp": cp} if cp > 1 else {}),
            **({"dp_replicate": dp_replicate} if dp_replicate > 1 else {}), **({"ep": ep} if ep > 1 else {})}


def _run_tokenizer(tokenizer: str | None):
    """The Hugging Face tokenizer a run's checkpoints carry (None for byte tokens, or token files without one)."""
    if tokenizer in (None, "bytes") or not has_tokenizer(tokenizer):
        return None
    return load_tokenizer(tokenizer, flag="the run's tokenizer")


def _say(message: str) -> None:
    print(f"tensorpar train: {message}", file=sys.stderr, flush=True)


def _init_header(args, init, config) -> str:
    """Rank 0's line on a fine-tune: the model the weights come from."""
    if args.init_from_hf:
        hf = json.loads((Path(args.init_from_hf) / "config.json").read_text())
        return (f"initialized from the Hugging Face model {Path(args.init_from_hf).resolve()} "
                f"({hf.get('model_type')}, {config.num_layers} layers, hidden {config.hidden_size}); "
                "a fresh optimizer and schedule from step 0")
    ckpt, _, meta = init
    return (f"initialized from the weights of {ckpt} (step {meta['step']} of its run, at TP {meta['world']['tp']}); "
            "a fresh optimizer and schedule from step 0")


def _run_config(args, config, *, sizes, device, device_name, tokens_per_step, rates, peak_source) -> dict:
    """Every effective setting of the run, as the config block at the top of the log shows it."""
    tp_size, dp_size = sizes
    derived = {"tp_size": tp_size, "dp_size": dp_size, "devices": rates.devices, "device": str(device),
               "device_name": device_name, "tokens_per_step": tokens_per_step,
               "flops_per_token": rates.flops_per_token, "peak_flops_per_s": rates.peak_flops_per_s,
               "peak_flops_source": peak_source}
    settings = args.settings()  # named as the flags and a --config file name them
    if settings.get("save-every") is None:  # at every evaluation: the interval that applies
        settings["save-every"] = args.eval_every
    return {"run": settings, "model": config_to_json(config), "derived": derived}


def _settings_header(args, run_config: dict) -> str:
    """The log's first lines: the settings the command gave (``args.given_settings``, as the run
    resolved them) as TOML, or, where the command did not say (a library call), every one."""
    given = args.given_settings
    every = f"{args.out}/config.toml" if args.out else "--print-config"
    if given is None:
        return "tensorpar train: run config (every effective setting, as TOML)\n" + config_block(run_config)
    shown = {k: v for k, v in run_config["run"].items() if k.replace("-", "_") in given}
    if not shown:
        return f"tensorpar train: every setting is its default (all of them: {every})"
    return (f"tensorpar train: settings given (the rest are defaults; all of them: {every})\n"
            + config_block({"run": shown}))


def train(args: RunConfig) -> RunResult:
    """Train on every rank of the current world (initializing tensorpar's groups), per ``args``
    (``tensorpar.cli.training_cli.parse_train_args`` makes one from ``train`` flags).

    Rank 0 holds the output directory's lock for the whole run. An error on any rank propagates
    at once, nothing on that path waits for a peer; the peers fail fast once this process exits.
    SIGTERM stops every rank after the same step, with a checkpoint; SIGINT raises
    ``KeyboardInterrupt`` at once, printing nothing (the command reports it in one line).
    """
    # Experts are whole on each rank (expert-tensor-parallel size 1), sharded over EP.
    ps.initialize_model_parallel(args.tp, args.pp, context_parallel_size=args.cp,
                                 expert_model_parallel_size=args.ep, expert_tensor_parallel_size=1,
                                 timeout=args.timeout)
    lock, signals = None, Signals()
    try:
        with signals:
            lock = _claim_out(args)
            if lock is not None and args.run_config:  # the settings the command resolved
                rundir.write_atomic(Path(args.out) / "config.toml", args.run_config.encode())
            result = _train(args, signals, set_aside=lock is not None and lock.set_aside is not None)
    except BaseException:
        # The groups stay up: tearing them down here would break the peers' pending collectives
        # at once, and their errors could be reported before this one. Exiting frees them.
        if not signals.interrupted:
            raise
        # Whatever the Ctrl-C broke (a collective a peer left) is not the cause; the command
        # that was interrupted says so once, naming the last checkpoint (checkpoint_files.resume_hint).
        raise KeyboardInterrupt from None
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
            outcome[0] = rundir.claim(args.out, resume=bool(args.resume), overwrite=args.overwrite,
                                      resume_from=resolve(args.resume) if args.resume else None)
        except (rundir.RunDirError, CheckpointError, OSError) as exc:
            outcome[1] = str(exc)
    if dist.get_world_size() > 1:
        shared = [outcome[1]]
        dist.broadcast_object_list(shared, src=0)
        outcome[1] = shared[0]
    if outcome[1] is not None:
        raise rundir.RunDirError(outcome[1])
    if outcome[0] is not None and outcome[0].set_aside is not None:
        what = "the newer checkpoints are" if args.resume else "the previous run is"
        why = "--overwrite" if args.overwrite else \
            f"--out {args.out} held a run stopped before its first checkpoint, started over"
        _say(f"{why}: {what} kept in {outcome[0].set_aside} until this run's first checkpoint is written")
    return outcome[0]


def _train(args, signals: Signals, *, set_aside: bool = False) -> RunResult:
    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_size = comm.group_size(pp_group)
    tp_size, dp_size, dp_rank = (comm.group_size(tp_group), comm.group_size(dp_group),
                                 comm.group_rank(dp_group))
    cp = ContextLayout.current(cp_comm=args.cp_comm)
    device = ps.default_device()
    is_rank0 = dist.get_rank() == 0
    resumed = open_checkpoint(args.resume) if args.resume else None
    init = open_checkpoint(args.init_from) if args.init_from else None
    started_from = resumed or init
    continue_settings(args, resumed[2] if resumed else None)
    ep_size = args.ep
    world = _world(tp=tp_size, dp=dp_size, pp=pp_size, cp=cp.size, dp_replicate=args.dp_replicate if args.fsdp else 1,
                   ep=ep_size)
    resolve_tokenizer(args, started_from[2] if started_from else None)
    corpus = load_corpus(args.data, tokenizer=args.tokenizer)
    data_record = {"tokens": corpus.tokens.numel(), "sha256": corpus.digest()} if args.data else {}
    if resumed:
        check_resumed_data(args, resumed[2], data_record)
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

    fsdp = args.fsdp
    ep_group = ps.get_expert_model_parallel_group() if config.num_moe_experts else None
    threads = _invariant_threads() if config.tp_invariant and device.type == "cpu" else None
    model_parallel_manual_seed(args.seed)
    model = GPT(config, cp_group=cp.group, device=device) if pp_size == 1 else pipeline_step.PipelinedGPT(
        config, schedule=args.pp_schedule, microbatches=args.grad_accum, virtual_stages=args.virtual_stages,
        device=device, fsdp_group=cp.grad_group if fsdp else None, min_unit_mib=args.fsdp_min_unit_mib, context=cp)
    if args.init_from_hf:
        from ..models.hf import load_weights

        try:
            load_weights(model, args.init_from_hf)
        except ValueError as exc:  # NaN/inf weights: only reading them can tell
            raise UsageError(f"--init-from-hf: {exc}") from None
    elif init:
        checkpoint.load(init[0], model=model, optimizer=None, tp_group=tp_group, restore_rng=False, pp_group=pp_group,
                        ep_group=ep_group)
    if fsdp and pp_size == 1:  # weights are replicated over DP and CP: FSDP shards over both
        fully_shard(model, dp_group=cp.grad_group, dp_replicate=args.dp_replicate, min_unit_mib=args.fsdp_min_unit_mib)
    optimizer = adamw(_param_groups(model, args.weight_decay), device=device, tp_invariant=config.tp_invariant,
                      lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    # The gradient helpers read the invariant mode from the parameters (marked by its layers). At
    # any DP size the step's micro-batches are summed in one tree over the global index. Its
    # layers sum each micro-batch's grads over CP in backward: only DP is left to the reducer (FSDP's
    # tree over DP x CP takes CP rank 0's).
    expert_dp_group = ps.get_expert_data_parallel_group() if config.num_moe_experts else None
    reducer = ShardedGradSync(model, micro_batches=args.grad_accum if config.tp_invariant else None,
                              cp_group=cp.group if config.tp_invariant else None, expert_dp_group=expert_dp_group) if fsdp \
        else grads.DataParallelGradReducer(
        model.parameters(), dp_group=dp_group if config.tp_invariant else cp.grad_group,
        micro_batches=args.grad_accum if config.tp_invariant else None,
        expert_dp_group=expert_dp_group)
    experts = ExpertBalance(model, groups=(tp_group, cp.group, dp_group), pp_group=pp_group) \
        if config.num_moe_experts else None
    loss_scale = 1 if config.tp_invariant else cp.loss_scale
    # Training steps run the compiled model; evaluation and checkpoints use the module itself.
    step_model = torch.compile(model) if args.compile else model
    params = list(model.parameters())
    # The group whose shards the grad norm sums: DP (x CP), under HSDP one replica's shards.
    norm_group = shard_group(next(p for p in params if isinstance(p, DTensor))) if fsdp else cp.grad_group
    start = 0
    out = Path(args.out) if args.out else None
    if resumed:
        ckpt, _, meta = resumed
        same_world = meta["world"] == world
        checkpoint.load(ckpt, model=model, optimizer=optimizer, tp_group=tp_group, restore_rng=same_world,
                        pp_group=pp_group, ep_group=ep_group)
        start = meta["step"]
        if not same_world:
            # Another layout has other ranks: continue with fresh, still reproducible, streams.
            model_parallel_manual_seed(args.seed + start)

    with autocast(args.dtype, device):  # overlap="auto": measured at the dtype the layers compute in
        calibrate_overlap(model, tokens=args.micro_batch * seq_len)
    num_parameters = count_parameters(model) if pp_size == 1 else model.num_parameters
    sampler = BatchSampler(train_tokens, seq_len=seq_len, micro_batch=args.micro_batch,
                           grad_accum=args.grad_accum, dp_rank=dp_rank, dp_size=dp_size, seed=args.seed,
                           rank_contiguous=config.tp_invariant)
    val_sampler = BatchSampler(val_tokens, seq_len=seq_len, micro_batch=args.micro_batch, grad_accum=1,
                               dp_rank=dp_rank, dp_size=dp_size, seed=args.seed, stream=1)
    # More batches than the split holds would only draw the same tokens again (and a huge count never ends).
    val_batches = max(1, len(val_tokens) // (seq_len * args.micro_batch * dp_size))
    eval_iters = min(args.eval_iters, val_batches)
    tokens_per_step = args.global_batch * seq_len
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak, peak_source = peak_flops_per_s(device_name, dtype=args.dtype)
    rates = Rates(devices=dist.get_world_size(), flops_per_token=flops_per_token(config, seq_len=seq_len),
                  peak_flops_per_s=peak)
    run_config = _run_config(args, config, sizes=(tp_size, dp_size), device=device, device_name=device_name,
                             tokens_per_step=tokens_per_step, rates=rates, peak_source=peak_source)
    if is_rank0:
        print(_settings_header(args, run_config), flush=True)
        print(f"tensorpar train: {num_parameters / 1e6:.2f}M parameters, "
              f"{cp.describe(tp=tp_size, dp=dp_size, seq_len=seq_len, sequence_parallel=config.sequence_parallel)}"
              + (f" PP={pp_size}" if pp_size > 1 else "") + (f", {experts_words(config, ep_size)}" if experts else "")
              + ", "
              f"global batch {args.global_batch} sequences ({args.micro_batch} per micro-batch x {dp_size} DP "
              f"x {args.grad_accum} accumulation) = {tokens_per_step:,} tokens/step, data: {corpus.source}"
              + (f" (micro-batch {args.micro_batch}: the {args.pp_schedule} schedule's {args.grad_accum} micro-batches; "
                 "--micro-batch sets it, as runs meant to match across layouts do)"
                 if args.micro_batch_chosen else ""),
              flush=True)
        if pp_size > 1:
            print(f"tensorpar train: {model.header}", flush=True)
        memory = ", ".join(f"{what} {n / 2**20:.2f} MiB" for what, n in bytes_per_rank(model).items())
        print(f"tensorpar train: per rank {memory}"
              + (f" ({describe_fsdp(model)})" if fsdp else ""),
              flush=True)
        if eval_iters < args.eval_iters and args.eval_every:
            _say(f"--eval-iters {args.eval_iters}: the validation split holds {val_batches} batches of "
                 f"{args.micro_batch} x {seq_len} tokens a DP rank; each evaluation runs {eval_iters}")
        if threads is not None:
            print(f"tensorpar train: --tp-invariant on CPU: {threads} intra-op thread{'s' if threads > 1 else ''} "
                  "a rank at every layout (OMP_NUM_THREADS sets the count: the bits depend on it, not on the layout)",
                  flush=True)
        if args.init_from or args.init_from_hf:
            print(f"tensorpar train: {_init_header(args, init, config)}", flush=True)
        if resumed:
            header, note = resume_header(args, resumed[2], ckpt=resumed[0], tp=tp_size, dp=dp_size, cp=cp.size,
                                         pp=pp_size, data=corpus.source)
            print(f"tensorpar train: {header}", flush=True)
            if note:
                _say(note)
        elif note := schedule_note(args):
            _say(note)
        if note := positions_note(args, config):
            _say(note)
    compiling = args.compile
    progress = Progress(out=out, total_steps=args.steps, first_step=start, enabled=is_rank0,
                        bar=not args.no_progress, tensorboard=args.tensorboard, rates=rates, device=device,
                        wandb_config=run_config if args.wandb else None, compiling=compiling)
    result = RunResult({}, {}, None, 0.0, config_to_json(config))
    measured_tokens, measured_time, first_step_rate = 0, 0.0, 0.0
    # Steps whose loss and grad norm stay on the device until the next log line: reading them
    # back every step would make the CPU wait for each step before queueing the next.
    pending: list[tuple[int, float, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if compiling:
        progress.say("compiling the model (torch.compile) during the first step: this can take minutes")
    interval_began = loop_began = time.perf_counter()
    control = control_group()
    save_every = args.eval_every if args.save_every is None else args.save_every
    written: list[str] = []  # this run's checkpoints (rank 0's record), oldest first
    try:
        for step in range(start, args.steps):
            lr = lr_at(step, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, total=args.lr_decay_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            reducer.zero_grad()
            batches = sampler.micro_batches(step)
            if model.dropout_masks is not None:  # TP-invariant masks: by global micro-batch, at any TP and DP size
                model.dropout_masks.counter = invariant_batches.first_micro_batch(
                    step, grad_accum=args.grad_accum, dp_size=dp_size, dp_rank=dp_rank)
            # The invariant mode: one division by the global micro-batch count, at any DP size.
            divisor = len(batches) * (dp_size if config.tp_invariant else 1)
            set_aux_loss_scale(loss_scale / divisor)  # the balance losses' share, as the loss's
            if pp_size > 1:
                losses = model.train_step(batches, reducer=reducer, dtype=args.dtype).to(device)
                loss_sum, losses = losses.sum(), list(losses.unbind())
            else:
                loss_sum, losses = torch.zeros((), dtype=torch.float64, device=device), []
                for k, (tokens, labels) in enumerate(batches):
                    reducer.sync = k == len(batches) - 1
                    with autocast(args.dtype, device):
                        loss = step_model(tokens.to(device), labels.to(device))
                    (loss * loss_scale / divisor).backward()
                    loss_sum += loss.detach().double()
                    losses.append(loss.detach())
            reducer.finish()
            if pp_size == 1:  # SP's partial grads, and a router's over TP ranks routing their own tokens
                grads.allreduce_sequence_parallel_grads(model)  # (a pipeline's schedule sums them itself)
            # FSDP's shards are summed over the group they split (norm_group); TP and PP as always.
            grad_norm = (grads.clip_grad_norm_(params, args.clip_grad, dp_group=norm_group, pp_group=pp_group,
                                               ep_group=ep_group)
                         if args.clip_grad > 0 else grads.get_grad_norm(params, dp_group=norm_group,
                                                                        pp_group=pp_group, ep_group=ep_group))
            optimizer.step()
            expert_stats = experts.finish_step(micro_batches=len(batches) * dp_size) if experts is not None \
                else torch.zeros(0, device=device)
            if config.tp_invariant:  # added in global micro-batch order
                mean = invariant_batches.mean_by_index(
                    losses, indices=range(dp_rank * len(batches), (dp_rank + 1) * len(batches)),
                    total=len(batches) * dp_size, dp_group=dp_group, device=device)
            else:
                comm.all_reduce(loss_sum, dp_group)
                mean = loss_sum / (len(batches) * dp_size)
            done = step + 1
            pending.append((done, lr, mean, grad_norm, expert_stats))
            log = done % args.log_every == 0 or done == args.steps or done == start + 1
            evaluating = bool(args.eval_every) and (done % args.eval_every == 0 or done == args.steps)
            stop = stop_requested(signals, control)
            saving = out is not None and bool(stop or (save_every and done % save_every == 0) or done == args.steps)
            # Also after the first step, whose one-off warm-up costs stay out of the measured rate.
            read_back = log or evaluating or saving or stop or done == start + 1
            if read_back:
                elapsed = time.perf_counter() - interval_began
                _read_back(pending, result, progress, tokens_per_s=tokens_per_step * len(pending) / elapsed, log=log)
                if done == start + 1:
                    first_step_rate = tokens_per_step / elapsed
                else:
                    measured_tokens, measured_time = measured_tokens + tokens_per_step * len(pending), \
                        measured_time + elapsed
                pending.clear()
                if compiling and done == start + 1:
                    progress.say(f"compiled: the first step took {time.perf_counter() - loop_began:.1f}s, "
                                 "compiling included")
            if evaluating:
                val = (invariant_batches.evaluate if config.tp_invariant else evaluate if pp_size == 1
                       else pipeline_step.evaluate)(
                    model, val_sampler, iters=eval_iters, dtype=args.dtype, device=device, dp_group=dp_group)
                result.val_losses[done] = val
                progress.eval(step=done, val_loss=val)
            if saving:
                result.checkpoint = _save(out, done, model=model, optimizer=optimizer, config=config,
                                          args=args, tokens_seen=done * tokens_per_step,
                                          world=world, hf_tokenizer=hf_tokenizer, data_record=data_record,
                                          ep_group=ep_group)
                if is_rank0:
                    if set_aside or args.overwrite:
                        rundir.remove_set_aside(out)  # the new run's first checkpoint is safely written
                    name = Path(result.checkpoint).name
                    written = [n for n in written if n != name] + [name]
                    try:
                        written = checkpoint.remove_old(out, written, keep=args.keep_last)
                    except OSError as exc:  # the run's checkpoints are intact: no reason to stop it
                        _say(f"--keep-last {args.keep_last}: could not remove an older checkpoint ({exc})")
            if read_back:  # the next rate counts training steps only, not this evaluation or save
                interval_began = time.perf_counter()
            if stop:
                result.stopped_by = "SIGTERM"
                if is_rank0:
                    where = f"checkpoint {result.checkpoint}" if result.checkpoint else "no --out, no checkpoint"
                    _say(f"stopped by SIGTERM after step {done}; {where}"
                         + (f" (continue with --resume {out})" if result.checkpoint else ""))
                break
        progress.plot()
        dist.destroy_process_group(control)
    finally:
        progress.close()
        reducer.remove_hooks()
    # A run of one step has only the first step's rate, warm-up costs and all.
    result.tokens_per_s = measured_tokens / measured_time if measured_time else first_step_rate
    return result
