"""Using a trained checkpoint: sample text from it (any TP size), export it to ``transformers``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from ..models.gpt import GPT
from . import checkpoint
from .data import decode, encode
from .loop import config_from_json


def load_model(path, *, tp_group) -> tuple[GPT, dict]:
    """The checkpoint's model at the current TP size (no SP, no recompute), in eval mode."""
    ckpt, config, meta = checkpoint.open_checkpoint(path)
    config = dataclasses.replace(config_from_json(config), sequence_parallel=False, recompute=False,
                                 distribute_saved_activations=False, gradient_accumulation_fusion=False,
                                 dropout=0.0, attention_dropout=0.0)
    model = GPT(config, tp_group=tp_group, device=ps.default_device())
    checkpoint.load(ckpt, model=model, optimizer=None, tp_group=tp_group, restore_rng=False)
    return model.eval(), meta


def generate(args) -> str:
    """Continue ``args.prompt``; the same text on every rank (the sampling stream is shared)."""
    ps.initialize_model_parallel(args.tp, timeout=args.timeout)
    try:
        model, meta = load_model(args.checkpoint, tp_group=ps.get_tensor_model_parallel_group())
        if meta.get("tokenizer") == "bytes":
            prompt = encode(args.prompt)
        else:
            prompt = torch.tensor([int(t) for t in args.prompt.split()], dtype=torch.int64)
        if prompt.numel() == 0:
            raise ValueError("--prompt is empty")
        torch.manual_seed(args.seed)
        out = model.generate(prompt[None].to(ps.default_device()), args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k)[0].cpu()
        if meta.get("tokenizer") == "bytes":
            return decode(out)
        return " ".join(str(int(t)) for t in out)
    finally:
        dist.barrier()
        ps.destroy_model_parallel()


def export_hf(args) -> str:
    """Write ``args.checkpoint`` as a ``transformers`` directory (GPT-2, Llama or Qwen2) at ``args.to_hf``."""
    from ..models.hf import to_hf

    ps.initialize_model_parallel(1, timeout=args.timeout)
    try:
        model, _ = load_model(args.checkpoint, tp_group=ps.get_tensor_model_parallel_group())
        out = Path(args.to_hf)
        to_hf(model, out)
        return str(out)
    finally:
        ps.destroy_model_parallel()
