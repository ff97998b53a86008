"""One GPU, one model trained two ways in one run: tensorpar's GPT as ``tensorpar train`` steps it,
and the same network written in plain PyTorch (``nn.Linear``, SDPA, fused AdamW, bf16 autocast).

Both hold fp32 weights and compute in bf16 autocast, take the same batch and do the same FLOPs;
each is timed eager and under ``torch.compile``. Reported per variant: tokens/s, MFU
(:func:`tensorpar.training.flops.flops_per_token` over the device's dense bf16 peak), peak memory,
and tensorpar's tokens/s over the plain model's. Shapes: GPT-2 small (vocabulary 50,304, seq
1024, as nanoGPT and llm.c) and Llama-3.2-1B (seq 2048). On a CPU it runs too (``--model tiny``:
the smoke test), without MFU.

Example::

    python benchmarks/gpu_train.py --model gpt2-small --micro-batch 16
    tensorpar bench --gpu                        # with the decode benchmark, one table
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.overlap import synchronize
from .launch import one_process_main

SHAPES = {
    "gpt2-small": dict(vocab_size=50304, max_seq_len=1024, num_layers=12, num_heads=12, hidden_size=768),
    "llama-1b": dict(vocab_size=128256, max_seq_len=2048, num_layers=16, num_heads=32, num_query_groups=8,
                     hidden_size=2048, ffn_hidden_size=8192, norm="rmsnorm", activation="swiglu",
                     position_embedding="rope", rope_theta=5e5, bias=False, tie_word_embeddings=True),
    "tiny": dict(vocab_size=256, max_seq_len=32, num_layers=2, num_heads=2, hidden_size=32),
}
MODES = ("eager", "compiled")


# ------------------------------------------------------------------ the plain model


def _norm(c) -> nn.Module:
    if c.norm == "rmsnorm":
        return nn.RMSNorm(c.hidden_size, eps=c.layernorm_epsilon)
    return nn.LayerNorm(c.hidden_size, eps=c.layernorm_epsilon, bias=c.bias)


class _Block(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.c, self.norm1, self.norm2 = c, _norm(c), _norm(c)
        kv = c.num_query_groups * c.head_dim
        self.qkv = nn.Linear(c.hidden_size, c.hidden_size + 2 * kv, bias=c.bias)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size, bias=c.bias)
        gated = c.activation == "swiglu"
        self.fc = nn.Linear(c.hidden_size, (2 if gated else 1) * c.ffn_hidden_size, bias=c.bias)
        self.out = nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=c.bias)

    def forward(self, x, cos, sin):
        c, (b, s, _) = self.c, x.shape
        q, k, v = self.qkv(self.norm1(x)).split([c.hidden_size, c.num_query_groups * c.head_dim,
                                                  c.num_query_groups * c.head_dim], dim=-1)
        q = q.view(b, s, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, s, c.num_query_groups, c.head_dim).transpose(1, 2)
        v = v.view(b, s, c.num_query_groups, c.head_dim).transpose(1, 2)
        if cos is not None:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=c.num_query_groups != c.num_heads)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, -1))
        hidden = self.fc(self.norm2(x))
        if c.activation == "swiglu":
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden, approximate="tanh" if c.activation == "gelu_tanh" else "none")
        return x + self.out(hidden)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class PlainGPT(nn.Module):
    """The GPT of a :class:`~tensorpar.models.GPTConfig`, written as a reader would write it."""

    def __init__(self, c) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_seq_len, c.hidden_size) if c.position_embedding == "learned" else None
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_layers))
        self.norm = _norm(c)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.head.weight = self.embed.weight
        if c.position_embedding == "rope":
            inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
            angles = torch.outer(torch.arange(c.max_seq_len).float(), inv).repeat(1, 2)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=c.init_std)

    def forward(self, tokens, labels):
        s = tokens.shape[1]
        x = self.embed(tokens)
        if self.position is not None:
            x = x + self.position.weight[:s]
        cos, sin = (self.cos[:s], self.sin[:s]) if self.position is None else (None, None)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


# ------------------------------------------------------------------ the two ways


@dataclasses.dataclass
class Measured:
    tokens_per_s: float
    mfu: float | None
    peak_memory_mib: float | None
    loss: float


def _tensorpar_step(config, device):
    """tensorpar's GPT and one training step as ``tensorpar train`` runs it at TP=1, DP=1."""
    from ..data_parallel.grads import DataParallelGradReducer
    from ..models import GPT
    from ..parallel_state import get_data_parallel_group
    from ..training.loop import _param_groups, adamw

    model = GPT(config, device=device)
    optimizer = adamw(_param_groups(model, 0.1), device=device, lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    reducer = DataParallelGradReducer(model.parameters(), dp_group=get_data_parallel_group())
    params = list(model.parameters())
    return model, lambda forward, tokens, labels: _step(forward, tokens, labels, optimizer, reducer, params)


def _step(forward, tokens, labels, optimizer, reducer, params):
    from ..data_parallel.grads import clip_grad_norm_

    reducer.zero_grad()
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        loss = forward(tokens, labels)
    loss.backward()
    reducer.finish()
    clip_grad_norm_(params, 1.0)
    optimizer.step()
    return loss.detach()


def _plain_step(config, device):
    model = PlainGPT(config).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    fused = {"fused": True} if device.type in ("cpu", "cuda") else {}
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), eps=1e-8, **fused)

    def step(forward, tokens, labels):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            loss = forward(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()
    return model, step


def _measure(build, config, args, device, *, compiled: bool) -> Measured:
    from ..training.flops import flops_per_token, peak_flops_per_s

    torch.manual_seed(0)
    model, step = build(config, device)
    forward = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step(forward, inputs, labels)
    synchronize(device)
    began = time.perf_counter()
    for _ in range(args.steps):
        loss = step(forward, inputs, labels)
    synchronize(device)
    elapsed = time.perf_counter() - began
    tokens_per_s = args.steps * inputs.numel() / elapsed
    peak, _ = peak_flops_per_s(torch.cuda.get_device_name(device) if device.type == "cuda" else None, dtype="bf16")
    mfu = tokens_per_s * flops_per_token(config, seq_len=args.seq_len) / peak if peak else None
    memory = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    del model, step, forward
    return Measured(tokens_per_s, mfu, memory, float(loss))


def _run(args) -> dict:
    from .. import parallel_state as ps
    from ..models import GPTConfig

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ps.initialize_model_parallel(1)
    try:
        config = GPTConfig(**{**SHAPES[args.model], "make_vocab_size_divisible_by": 64})
        args.seq_len = args.seq_len or config.max_seq_len
        results = {}
        for mode in args.modes:
            for name, build in (("tensorpar", _tensorpar_step), ("plain", _plain_step)):
                results[f"{name} {mode}"] = dataclasses.asdict(
                    _measure(build, config, args, device, compiled=mode == "compiled"))
            ours, theirs = results[f"tensorpar {mode}"], results[f"plain {mode}"]
            results[f"ratio {mode}"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        return {"device": name, "model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                "results": results}
    finally:
        ps.destroy_model_parallel()


def report(result: dict) -> str:
    """The table of one run."""
    lines = [f"training, {result['model']} at seq {result['seq_len']}, micro-batch {result['micro_batch']}, "
             f"bf16 autocast, on {result['device']}:"]
    for key, value in result["results"].items():
        if key.startswith("ratio"):
            lines.append(f"  tensorpar / plain, {key.split()[1]}: {value:.3f}")
            continue
        mfu = f"{100 * value['mfu']:.1f}%" if value["mfu"] is not None else "n/a"
        memory = f"{value['peak_memory_mib']:,.0f} MiB" if value["peak_memory_mib"] is not None else "n/a"
        lines.append(f"  {key:<20} {value['tokens_per_s']:>12,.0f} tokens/s  MFU {mfu:>6}  peak memory {memory}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=tuple(SHAPES), default="gpt2-small")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the shape's")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation among them)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> dict:
    return one_process_main(argv, description=__doc__.splitlines()[0], add_arguments=add_arguments, run=_run,
                      report=report)
