"""Decoding on one GPU against its floor: ms per new token of a random bf16 Llama at batch 1.

Variants, in one run on the same weights: ``GPT.generate`` eager, and with its decode step
replayed from a CUDA graph (CUDA only); ``transformers``' ``generate`` with its static cache,
where transformers is installed (the same weights, exported with :func:`tensorpar.models.to_hf`).
The floor is what streaming every weight once per token costs: the weights' bytes over the copy
bandwidth measured in the same run (a device-to-device copy of a buffer as large as the
weights, read once and written once). A decode step's time per token is ``(T(n new tokens) -
T(1 new token)) / (n - 1)``: the prefill cancels. Shapes: Llama-3-8B (32 layers, hidden 4096,
32/8 heads, FFN 14,336, vocabulary 128,256), built on the GPU, nothing downloaded; ``tiny`` for
the CPU smoke test.

Example::

    python benchmarks/gpu_decode.py --model llama3-8b --new-tokens 128
"""

from __future__ import annotations

import argparse

import torch

from ..tensor_parallel.overlap import median_seconds
from .launch import one_process_main

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, max_seq_len=2048, num_layers=32, num_heads=32, num_query_groups=8,
                      hidden_size=4096, ffn_hidden_size=14336),
    "tiny": dict(vocab_size=256, max_seq_len=64, num_layers=2, num_heads=4, num_query_groups=2, hidden_size=32,
                 ffn_hidden_size=64),
}
LLAMA = dict(norm="rmsnorm", activation="swiglu", position_embedding="rope", rope_theta=5e5, bias=False,
             tie_word_embeddings=False, params_dtype=torch.bfloat16, make_vocab_size_divisible_by=64)


def _copy_bytes_per_s(nbytes: int, device, rounds: int) -> float:
    """Bytes a device-to-device copy reads per second (each byte read once and written once)."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device, rounds)
    return source.numel() * source.element_size() * 2 / seconds  # read and write: the DRAM traffic


def _per_token_ms(generate, device, args) -> tuple[float, torch.Tensor]:
    # (each timing's first call warms up: the CUDA graph's capture among it)
    first = median_seconds(lambda: generate(1), device, args.rounds)
    out = []
    full = median_seconds(lambda: out.append(generate(args.new_tokens)), device, args.rounds)
    return (full - first) / (args.new_tokens - 1) * 1e3, out[-1]


def _run(args) -> dict:
    from .. import parallel_state as ps
    from ..models import GPT, GPTConfig

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ps.initialize_model_parallel(1)
    try:
        torch.manual_seed(0)
        config = GPTConfig(**SHAPES[args.model], **LLAMA)
        model = GPT(config, device=device).eval()
        prompt = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
        prompt = prompt.to(device)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bandwidth = _copy_bytes_per_s(weight_bytes, device, args.rounds)
        variants = {"tensorpar eager": lambda n: model.generate(prompt, n, temperature=0)}
        if device.type == "cuda":
            variants["tensorpar CUDA graph"] = lambda n: model.generate(prompt, n, temperature=0, cuda_graph=True)
        hf = _transformers_model(model)
        if hf is not None:
            variants["transformers static cache"] = lambda n: hf.generate(
                prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                pad_token_id=0)
        results, tokens = {}, {}
        with torch.no_grad():
            for name, generate in variants.items():
                results[name], tokens[name] = _per_token_ms(generate, device, args)
        floor_ms = weight_bytes / (bandwidth / 2) * 1e3  # each token reads every weight once
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        same = all(torch.equal(t, tokens["tensorpar eager"]) for n, t in tokens.items() if n.startswith("tensorpar"))
        return {"device": name, "model": args.model, "new_tokens": args.new_tokens, "weight_gib": weight_bytes / 2**30,
                "copy_gb_per_s": bandwidth / 1e9, "floor_ms": floor_ms, "ms_per_token": results,
                "over_floor": {n: ms / floor_ms for n, ms in results.items()}, "tensorpar_tokens_agree": same}
    finally:
        ps.destroy_model_parallel()


def _transformers_model(model):
    """The same weights as a ``transformers`` Llama built on the model's device, or None without
    transformers."""
    try:
        import transformers
    except ImportError:
        return None
    from ..models.hf import hf_config_of, hf_state_dict

    config = hf_config_of(model.config)
    with torch.device(next(model.parameters()).device):
        hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    hf.load_state_dict(hf_state_dict(model), strict=True)
    hf.generation_config.max_length = None  # max_new_tokens says how many
    return hf.eval()


def report(result: dict) -> str:
    lines = [f"decoding, {result['model']} ({result['weight_gib']:.2f} GiB of bf16 weights), batch 1, "
             f"{result['new_tokens']} new tokens, on {result['device']}: floor {result['floor_ms']:.3f} ms/token "
             f"(copy {result['copy_gb_per_s']:,.0f} GB/s read + write)"]
    for name, ms in result["ms_per_token"].items():
        lines.append(f"  {name:<26} {ms:>9.3f} ms/token  {result['over_floor'][name]:>6.2f} x floor")
    if not result["tensorpar_tokens_agree"]:
        lines.append("  the CUDA graph's tokens differ from the eager ones")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=tuple(SHAPES), default="llama3-8b")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> dict:
    return one_process_main(argv, description=__doc__.splitlines()[0], add_arguments=add_arguments, run=_run,
                      report=report)
