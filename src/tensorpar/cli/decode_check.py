"""The GPU check's decode stage: tensorpar's greedy decode next to ``transformers``' ``generate``.

A random Llama (grouped-query attention) is saved as a ``transformers`` model directory, loaded by
both, and the same prompts are decoded greedily by ``GPT.generate``'s path, by its fixed-shape
step (captured in a CUDA graph on CUDA; run eagerly on CPU) and by ``transformers`` (its static
cache where it has one, not compiled: its compile would take most of the check's time). Decode
ms/token = ``(T(new tokens) - T(1 token)) / (new - 1)``, medians over rounds in which the
variants take turns. ``transformers`` is optional: without it the stage says so and is skipped.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from ..models import from_hf
from ..models.generation import Decoder, generate, last_logits
from ..tensor_parallel.overlap import synchronize

# A differing token is a near tie (which the kernels' rounding decides) where the reference's logit
# for it is within NEAR_TIE x max|logit| of the reference's best; any other difference fails.
NEAR_TIE = 5e-2


def _hf_generation_kwargs(transformers) -> dict:
    """Greedy ``generate`` arguments: the static cache and no automatic compile where offered."""
    from transformers.generation import configuration_utils as options

    kwargs = dict(do_sample=False, pad_token_id=0)
    implementations = (*getattr(options, "ALL_CACHE_IMPLEMENTATIONS", ()),
                       *getattr(options, "NEED_SETUP_CACHE_CLASSES_MAPPING", {}))
    if "static" in implementations:
        kwargs["cache_implementation"] = "static"
    if hasattr(transformers.GenerationConfig(), "disable_compile"):
        kwargs["disable_compile"] = True
    return kwargs


def agreement(tokens: torch.Tensor, reference: torch.Tensor, reference_logits, *, prompt_len: int) -> dict:
    """How ``tokens`` (``[b, prompt + new]``) agree with ``reference``: the sequences equal, and
    those that first differ at a near tie of ``reference_logits`` (one ``[b, vocab]`` per new
    token); ``differ`` lists the others as (sequence, new token, margin, scale)."""
    new, expected = tokens[:, prompt_len:].cpu(), reference[:, prompt_len:].cpu()
    equal = (new == expected).all(1)
    ties, differ = 0, []
    for row in (~equal).nonzero().flatten().tolist():
        step = int((new[row] != expected[row]).nonzero()[0])
        logits = reference_logits[step][row].float()
        margin, scale = float(logits.max() - logits[new[row, step]]), float(logits.abs().max())
        if margin <= NEAR_TIE * scale:
            ties += 1
        else:
            differ.append((row, step, round(margin, 4), round(scale, 4)))
    return {"equal": int(equal.sum()), "near_ties": ties, "differ": differ}


def _decode_ms(generators: dict, *, new_tokens: int, rounds: int, device) -> dict:
    """{name: decode ms/token} of each ``generate(n)``, the variants taking turns each round."""
    times = {name: ([], []) for name in generators}
    for _ in range(rounds):
        for name, run in generators.items():
            for n, series in zip((1, new_tokens), times[name]):
                synchronize(device)
                began = time.perf_counter()
                run(n)
                synchronize(device)
                series.append(time.perf_counter() - began)
    return {name: (statistics.median(full) - statistics.median(first)) / (new_tokens - 1) * 1e3
            for name, (first, full) in times.items()}


@torch.no_grad()
def _graph_step_ms(model, prompt: torch.Tensor, steps: int, device) -> float:
    """Ms per replayed fixed-shape decode step (and its argmax), after the capture."""
    batch, length = prompt.shape
    is_real = torch.ones(batch, length + steps + 1, dtype=torch.bool, device=device)
    cache = model.new_kv_cache(batch, length + steps + 1)
    decoder = Decoder(model, cache, is_real, prompt=length, fixed_shapes=True, cuda_graph=device.type == "cuda")
    token = last_logits(model, prompt, is_real[:, :length], cache).argmax(-1)
    token = decoder.step(token).argmax(-1)       # the capture
    synchronize(device)
    began = time.perf_counter()
    for _ in range(steps - 1):
        token = decoder.step(token).argmax(-1)
    synchronize(device)
    return (time.perf_counter() - began) / (steps - 1) * 1e3


def measure_decode(device, *, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, batch: int,
                   prompt_len: int, new_tokens: int, dtype: torch.dtype, rounds: int) -> dict:
    """Decode ms/token of tensorpar (eager, and the fixed-shape step graphed on CUDA) and of
    ``transformers`` on the same random Llama, and whether they chose the same tokens (``ok``)."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed (the optional extra: pip install 'tensorpar[hf]')"}
    transformers.utils.logging.disable_progress_bar()     # one line per stage
    ffn = -(-hidden * 8 // 3 // 256) * 256
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=prompt_len + new_tokens,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)   # no EOS: every run has new_tokens
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="tensorpar-decode-check-") as directory:
        transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(directory)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory).to(device=device, dtype=dtype).eval()
        model = from_hf(directory, device=device, params_dtype=dtype).eval()
    prompt = torch.randint(1, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    kwargs = _hf_generation_kwargs(transformers)
    graph = device.type == "cuda"
    generators = {
        "transformers": lambda n: hf.generate(prompt, max_new_tokens=n, **kwargs),
        "tensorpar": lambda n: generate(model, prompt, n, temperature=0),
        "tensorpar_graph": lambda n: generate(model, prompt, n, temperature=0, cuda_graph=True),
    }
    with torch.no_grad():
        reference = hf.generate(prompt, max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                                **kwargs)
        tokens = {name: agreement(generators[name](new_tokens), reference.sequences, reference.logits,
                                  prompt_len=prompt_len)
                  for name in ("tensorpar", "tensorpar_graph")}
        ms = _decode_ms(generators, new_tokens=new_tokens, rounds=rounds, device=device)
        step_ms = _graph_step_ms(model, prompt, new_tokens, device)
    return {
        "model": f"Llama hidden {hidden}, {layers} layers, {heads}/{kv_heads} heads, vocab {vocab}, "
                 f"{str(dtype).removeprefix('torch.')}",
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "transformers_cache": kwargs.get("cache_implementation", "dynamic"),
        "cuda_graph": graph,
        "transformers_ms_per_token": ms["transformers"],
        "tensorpar_ms_per_token": ms["tensorpar"],
        "tensorpar_graph_ms_per_token": ms["tensorpar_graph"],
        "graph_step_ms": step_ms,
        "ratio": ms["tensorpar"] / ms["transformers"],
        "graph_ratio": ms["tensorpar_graph"] / ms["transformers"],
        "tokens": tokens,
        "ok": not any(result["differ"] for result in tokens.values()),
    }
