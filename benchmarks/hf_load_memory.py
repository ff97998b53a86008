"""Peak memory per rank of ``tensorpar.models.from_hf(DIR)`` at TP 1, 2, 4: one shard, not the model.

A random Llama (grouped-query attention, untied head) is saved once as safetensors; then for each
TP size, in fresh processes, each rank loads its shard with ``from_hf`` while two peaks are
recorded: anonymous memory (RssAnon, sampled every millisecond: tensors and heap) and the
resident set (VmHWM after resetting it), which also counts the page cache of the memory-mapped
safetensors pages the rank touched. For comparison, ``transformers``' ``from_pretrained`` of the
whole model (reading every weight), which is what loading and then sharding would cost. Linux only.

    python benchmarks/hf_load_memory.py [--hidden 1024] [--layers 8] [--vocab 32000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

MIB = 1 << 20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class _AnonymousPeak:
    """Samples RssAnon (heap and tensors, not the page cache of mapped files) every millisecond."""

    def __enter__(self):
        self.peak, self._stop = _status("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _measured(load) -> dict:
    """Resident memory before, and peaks while ``load()`` runs (all in bytes)."""
    before, anon_before = _status("VmRSS"), _status("RssAnon")
    _reset_peak()
    with _AnonymousPeak() as anon:
        result = load()
    return {"rss_growth": _status("VmHWM") - before, "anon_growth": anon.peak - anon_before, "result": result}


def _load_shard(directory: str, tp_size: int) -> dict:
    import tensorpar as tp
    from tensorpar.models import from_hf

    tp.initialize_model_parallel(tp_size)
    try:
        import transformers  # noqa: F401  (imported before the baseline, as from_hf needs it)

        measured = _measured(lambda: from_hf(directory))
        model = measured.pop("result")
        return {**measured, "shard": sum(p.numel() * p.element_size() for p in model.parameters())}
    finally:
        tp.destroy_model_parallel()


def _load_whole_with_transformers(directory: str) -> dict:
    import transformers

    def load():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        return sum(float(p.sum()) for p in model.parameters())  # every weight really read

    measured = _measured(load)
    measured.pop("result")
    return measured


def _measure(kind: str, directory: str, tp_size: int) -> list[dict]:
    """One measurement, in this (fresh) process and the ones it starts."""
    from tensorpar.cli.launch import launch_local

    if kind == "transformers":
        return [_load_whole_with_transformers(directory)]
    return list(launch_local(_load_shard, directory, tp_size, nproc=tp_size).values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dir", default=None, help="where to save the random model (default: a temporary directory)")
    parser.add_argument("--measure", choices=("tensorpar", "transformers"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.measure:
        print(json.dumps(_measure(args.measure, args.dir, args.tp[0])))
        return

    import transformers

    directory = Path(args.dir or tempfile.mkdtemp(prefix="tensorpar-hf-load-"))
    if not (directory / "config.json").is_file():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            tie_word_embeddings=False)
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
    file_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))

    def measure(kind: str, tp_size: int) -> list[dict]:
        # Each measurement in fresh processes: nothing freed earlier is reused by the allocator.
        out = subprocess.run([sys.executable, __file__, "--measure", kind, "--dir", str(directory),
                              "--tp", str(tp_size)], capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    print(f"model: {file_bytes / MIB:,.0f} MiB of safetensors (fp32) in {directory}")
    print("| loader | TP | weights per rank (MiB) | peak anonymous memory growth per rank (MiB) | "
          "/ weights per rank | peak RSS growth per rank, incl. mapped file pages (MiB) |")
    print("|---|---|---|---|---|---|")
    rows = [("transformers from_pretrained, whole model", 1, measure("transformers", 1), file_bytes)]
    for tp_size in args.tp:
        results = measure("tensorpar", tp_size)
        rows.append(("tensorpar from_hf(DIR)", tp_size, results, max(r["shard"] for r in results)))
    for name, tp_size, results, shard in rows:  # the worst rank of each
        anon, rss = max(r["anon_growth"] for r in results), max(r["rss_growth"] for r in results)
        print(f"| {name} | {tp_size} | {shard / MIB:,.0f} | {anon / MIB:,.0f} | {anon / shard:.2f} | "
              f"{rss / MIB:,.0f} |")


if __name__ == "__main__":
    main()
