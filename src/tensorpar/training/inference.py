"""Using a trained checkpoint: sample text from it (any TP size), export it to ``transformers``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from ..planning.communication import calibrate_overlap
from ..errors import UsageError
from ..models.gpt import GPT
from . import checkpoint
from .checkpoint_files import open_checkpoint, read_manifest
from .checkpoint_format import CheckpointRefused
from .data import EOT, decode, encode
from .dcp_metadata import read_metadata, size_problem
from .memory import check_inference_memory
from .model_config import check_fits, config_from_json


def load_model(path, *, tp_group) -> tuple[GPT, dict]:
    """The checkpoint's model at the current TP size (no SP, no recompute), in eval mode."""
    ckpt, config, meta = open_checkpoint(path)
    config = dataclasses.replace(config_from_json(config), sequence_parallel=False, recompute=False,
                                 distribute_saved_activations=False, gradient_accumulation_fusion=False,
                                 dropout=0.0, attention_dropout=0.0)
    problem = size_problem(read_metadata(ckpt, listed=set(read_manifest(ckpt))).state_dict_metadata, config)
    if problem is not None:
        raise CheckpointRefused(f"checkpoint {ckpt}: {problem}")
    model = GPT(config, tp_group=tp_group, device=ps.default_device())
    checkpoint.load(ckpt, model=model, optimizer=None, tp_group=tp_group, restore_rng=False)
    return model.eval(), meta


def run_tokenizer(meta: dict):
    """The run's Hugging Face tokenizer, or None for byte tokens and token files without one."""
    if meta.get("tokenizer") in (None, "bytes"):
        return None
    from .tokenizer import load_tokenizer

    return load_tokenizer(meta["tokenizer"], flag="the run's tokenizer")


def encode_prompt(prompt: str, *, tokenizer: str | None, vocab_size: int) -> torch.Tensor:
    """``prompt`` as token ids: its UTF-8 bytes for byte-level runs, the run's Hugging Face
    tokenizer's ids, else ids separated by spaces."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed on that are no UTF-8 text
        raise UsageError(f"--prompt {ascii(prompt)} is not UTF-8 text") from None
    hf_tokenizer = run_tokenizer({"tokenizer": tokenizer})
    if tokenizer == "bytes":
        tokens = encode(prompt)
    elif hf_tokenizer is not None:
        tokens = torch.tensor(hf_tokenizer(prompt)["input_ids"], dtype=torch.int64)
    else:
        words = prompt.split()
        bad = [word for word in words if not (word.isascii() and word.isdigit())]
        if bad:
            raise UsageError(f"--prompt {prompt!r}: this checkpoint was trained on a token file, so the prompt "
                             f"is token ids separated by spaces (e.g. --prompt \"464 2068\"); {bad[0]!r} is not one")
        for word in words:  # before a tensor: an id past int64 would overflow it (and int() past 4300 digits)
            if len(word.lstrip("0")) > len(str(vocab_size)) or int(word) >= vocab_size:
                shown = word if len(word) <= 30 else word[:27] + "..."
                raise UsageError(f"--prompt: token id {shown} is outside the model's vocabulary of {vocab_size}")
        tokens = torch.tensor([int(word) for word in words], dtype=torch.int64)
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise UsageError(f"--prompt: token id {int(tokens.max())} is outside the model's vocabulary "
                         f"of {vocab_size}")
    if tokens.numel() == 0:
        raise UsageError("--prompt is empty: give at least one token to continue")
    return tokens


def check_generate(args, *, saved: dict, meta: dict, local_ranks: int) -> None:
    """What ``tensorpar generate`` refuses before any rank starts: a TP size the checkpoint's model
    cannot run at, a bad ``--tokenizer`` (named as such), a prompt outside the vocabulary, and a
    model (weights, KV cache) beyond each rank's memory; ``args.tokenizer`` made absolute."""
    config = config_from_json(saved)
    check_fits(config, tp=args.tp, seq_len=None)
    if args.tokenizer is not None:
        from .tokenizer import load_tokenizer

        size = len(load_tokenizer(args.tokenizer))
        if size > config.vocab_size:
            raise UsageError(f"--tokenizer {args.tokenizer}: its {size:,} tokens are more than the model's vocabulary "
                             f"of {config.vocab_size:,}: it is not the tokenizer the model was trained with")
        args.tokenizer = str(Path(args.tokenizer).resolve())
    prompt = encode_prompt(args.prompt, tokenizer=args.tokenizer or meta.get("tokenizer"), vocab_size=config.vocab_size)
    check_inference_memory(config, tp=args.tp, tokens=prompt.numel() + args.max_new_tokens, local_ranks=local_ranks)


def generate(args) -> str:
    """Continue ``args.prompt``; the same text on every rank (the sampling stream is shared)."""
    ps.initialize_model_parallel(args.tp, expert_tensor_parallel_size=1, timeout=args.timeout)
    # An error propagates as it is, the groups left up: waiting on a peer or tearing the groups
    # down here would hide it behind a timeout or a peer's broken-connection error.
    model, meta = load_model(args.checkpoint, tp_group=ps.get_tensor_model_parallel_group())
    tokenizer = args.tokenizer or meta.get("tokenizer")
    prompt = encode_prompt(args.prompt, tokenizer=tokenizer, vocab_size=model.config.vocab_size)
    hf_tokenizer = run_tokenizer({"tokenizer": tokenizer})
    calibrate_overlap(model, tokens=prompt.numel())  # for a checkpoint trained with --overlap auto
    torch.manual_seed(args.seed)
    # A document ends with EOS (EOT for byte tokens): generation stops there, as transformers'
    # does with the exported model, and the text leaves it out.
    eos = EOT if tokenizer == "bytes" else hf_tokenizer.eos_token_id if hf_tokenizer is not None else None
    out = model.generate(prompt[None].to(ps.default_device()), args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, eos_token_id=eos)[0].cpu()
    if tokenizer == "bytes":
        ends = (out[prompt.numel():] == EOT).nonzero()
        text = decode(out[:prompt.numel() + int(ends[0])] if len(ends) else out)
    elif hf_tokenizer is not None:
        text = hf_tokenizer.decode(out.tolist(), skip_special_tokens=True)
    else:
        text = " ".join(str(int(t)) for t in out)
    dist.barrier()  # nobody tears down gloo while a peer still talks to it
    ps.destroy_model_parallel()
    return text


def export_hf(args) -> tuple[str, int, int]:
    """Write ``args.checkpoint`` as a ``transformers`` directory (GPT-2, Llama or Qwen2) at ``args.to_hf``;
    returns the directory, the checkpoint's step and the context length written (``max_length``)."""
    from ..models.hf import save_pretrained, to_hf
    from .tokenizer import byte_tokenizer, save_tokenizer

    ps.initialize_model_parallel(1, timeout=args.timeout)
    try:
        model, meta = load_model(args.checkpoint, tp_group=ps.get_tensor_model_parallel_group())
        out = Path(args.to_hf)
        hf_model = to_hf(model)
        hf_tokenizer = run_tokenizer(meta)
        if meta.get("tokenizer") == "bytes":  # ids are bytes, each document ends with EOT
            hf_tokenizer = byte_tokenizer(max_length=model.config.max_seq_len)
        bos = eos = None
        if hf_tokenizer is not None:
            bos, eos = hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id
        for config in (hf_model.config, hf_model.generation_config):
            config.bos_token_id, config.eos_token_id = bos, eos
        save_pretrained(hf_model, out)
        if hf_tokenizer is not None:  # pipeline("text-generation", model=out) finds it there
            save_tokenizer(hf_tokenizer, out)
        return str(out), meta["step"], model.config.max_seq_len
    finally:
        ps.destroy_model_parallel()
