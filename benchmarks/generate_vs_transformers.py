"""Greedy generation tokens/s: tensorpar's KV-cache ``GPT.generate`` at TP 1 and 2 next to
``transformers``' ``generate`` on the same random Llama, in the same run (gloo/CPU, one thread
per rank).

Prefill tokens/s = ``batch * prompt_len / T(generate 1 token)``; decode tokens/s =
``batch * (new_tokens - 1) / (T(generate new_tokens) - T(generate 1 token))``; each time the
median of ``--rounds`` rounds, in which the variants of one world take turns. The generated tokens are checked equal across all variants.
The decode time per token is also given in the rank's CPU time (``time.process_time``, one
thread), which the machine's other load moves far less than the wall clock.
``transformers`` at TP=2 uses its own ``tp_plan="auto"``, where it runs on this machine.

    python benchmarks/generate_vs_transformers.py [--hidden 512] [--layers 4] [--batch 4]
        [--prompt-len 64] [--new-tokens 64] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _hf_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_len + args.new_tokens, tie_word_embeddings=False)


def _rates(generators: dict, args) -> dict:
    """{name: (prefill tokens/s, decode tokens/s, the tokens)} of each ``generate(n)``: medians
    over rounds, the variants taking turns within each round so they share the machine's noise."""
    import torch.distributed as dist

    times = {name: ([], []) for name in generators}
    cpu = {name: ([], []) for name in generators}
    out = {}
    for generate in generators.values():
        generate(2)  # warm-up
    for _ in range(args.rounds):
        for name, generate in generators.items():
            for n, series, cpu_series in zip((1, args.new_tokens), times[name], cpu[name]):
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                out[name] = generate(n)
                series.append(time.perf_counter() - start)
                cpu_series.append(time.process_time() - cpu_start)
    rates = {}
    for name, (first, full) in times.items():
        t1, tn = statistics.median(first), statistics.median(full)
        cpu_ms = (statistics.median(cpu[name][1]) - statistics.median(cpu[name][0])) / (args.new_tokens - 1) * 1e3
        rates[name] = (args.batch * args.prompt_len / t1, args.batch * (args.new_tokens - 1) / (tn - t1),
                       cpu_ms, out[name].tolist())
    return rates


def _rank(args, directory: str) -> dict:
    import torch
    import torch.distributed as dist
    import transformers

    import tensorpar as tp
    from tensorpar.models import from_hf

    tp.initialize_model_parallel(int(os.environ["WORLD_SIZE"]))
    world = dist.get_world_size()
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = from_hf(directory).eval()
        generators = {f"tensorpar TP={world}": lambda n: model.generate(prompt, n, temperature=0)}
        failed = {}
        try:
            if world == 1:
                hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
            else:
                hf = transformers.AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto").eval()
            name = "transformers" if world == 1 else f"transformers tp_plan=auto TP={world}"
            generators[name] = lambda n: hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                     pad_token_id=0)
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            failed[f"transformers tp_plan=auto TP={world}"] = f"did not run: {type(exc).__name__}: {exc}"
        results = {**_rates(generators, args), **failed}
    tp.destroy_model_parallel()
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch
    import transformers

    from tensorpar.cli.launch import launch_local

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.manual_seed(0)
    directory = tempfile.mkdtemp(prefix="tensorpar-generate-bench-")
    transformers.LlamaForCausalLM(_hf_config(args)).save_pretrained(directory)
    load_before = os.getloadavg()[0]
    results = {}
    for world in (1, 2):
        results.update(launch_local(_rank, args, directory, nproc=world)[0])
    if args.json:
        print(json.dumps(results))
        return
    baseline = results["transformers"]
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} K/V heads, "
          f"vocab {args.vocab}; batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| variant | prefill tokens/s | decode tokens/s | decode vs transformers TP=1 | decode CPU ms/token "
          "| CPU time / transformers' | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, value in results.items():
        if isinstance(value, str):
            print(f"| {name} | {value} | | | | | |")
            continue
        prefill, decode, cpu_ms, tokens = value
        print(f"| {name} | {prefill:,.0f} | {decode:,.0f} | {decode / baseline[1]:.2f}x | {cpu_ms:.2f} | "
              f"{cpu_ms / baseline[2]:.2f}x | {'yes' if tokens == baseline[3] else 'NO'} |")


if __name__ == "__main__":
    main()
