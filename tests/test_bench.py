"""Smoke tests of ``tensorpar bench`` and ``benchmarks/ring_overlap.py`` at tiny sizes: the
report's structure, never its timings."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import tensorpar as tp
from tensorpar.cli import bench, bench_variants
from tensorpar.cli.main import main
from tests.harness import run_on_ranks

TINY = dict(tp=2, seq=4, batch=2, hidden=8, ffn_mult=2, rounds=1, warmup=1, iters=1, gpt_layers=1, gpt_heads=2,
            gpt_vocab=16)


def _check_structure(report: dict) -> None:
    assert report["config"]["tp"] == 2 and report["config"]["ffn_hidden"] == 16
    tp_variants = set(bench.VARIANTS) - {bench.UNSHARDED}
    assert set(report["median_ms"]) == set(report["range_ms"]) == set(bench.VARIANTS)
    assert set(report["scaling_efficiency"]) == tp_variants
    assert set(report["speedup_vs_dtensor"]) == set(bench.DTENSOR_PEER)
    assert set(report["fraction_of_ceiling"]) == tp_variants - {bench.COMPUTE_ONLY}
    assert set(report["gpt"]["median_ms"]) == set(bench.GPT_VARIANTS)
    assert set(report["gpt"]["scaling_efficiency"]) == set(bench.GPT_VARIANTS) - {bench.GPT_TP1}
    assert set(report["cpu_ms_per_iteration"]) == set(bench.VARIANTS)
    assert set(report["gpt"]["cpu_ms_per_iteration"]) == set(bench.GPT_VARIANTS)
    assert 0 <= report["link_model"]["overlap"] <= 1 and report["link_model"]["bytes_per_s"] > 0
    assert len(report["rounds_ms"]) == 1 and set(report["rounds_ms"][0]) == set(bench.VARIANTS)
    values = [*report["median_ms"].values(), *report["scaling_efficiency"].values(),
              *report["speedup_vs_dtensor"].values(), report["overlap_speedup"],
              *report["fraction_of_ceiling"].values(), *report["gpt"]["median_ms"].values(),
              *report["gpt"]["scaling_efficiency"].values()]
    assert all(v > 0 for v in values)


def test_measure_on_two_ranks_reports_every_variant():
    # measure() also checks every variant's output and grads against the unsharded block.
    reports = run_on_ranks(bench.measure, 2, bench.BenchConfig(**TINY))
    assert reports[0] == reports[1]
    _check_structure(reports[0])
    table = bench.format_report(reports[0])
    assert all(label in table for label in [*bench.LABELS.values(), *bench.GPT_LABELS.values()])


def test_cli_spawns_ranks_and_prints_json(capsys):
    argv = ["bench", "--json"] + [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    assert main(argv) == 0
    _check_structure(json.loads(capsys.readouterr().out))


@pytest.mark.parametrize("bad", [dict(tp=1), dict(seq=3), dict(hidden=9), dict(iters=0), dict(dtype="fp16"),
                                 dict(chunks=0), dict(gpt_heads=3), dict(gpt_layers=-1)])
def test_config_rejects_unusable_sizes(bad):
    with pytest.raises(ValueError):
        bench.BenchConfig(**{**TINY, **bad})


def _overlap_variants_body():
    """Under a group that refuses tensors off the backend's device (as NCCL refuses CPU ones)."""
    from tests.strict_device import strict_collective_device

    tp.initialize_model_parallel(torch.distributed.get_world_size())
    with strict_collective_device(tp.get_tensor_model_parallel_group()):
        return bench_variants.measure_overlap_variants(torch.device("cpu"), hidden=16, seq=8, batch=2, dtype=torch.float32,
                                              iters=1)


def test_overlap_variants_on_any_device_check_results_and_report_the_ceiling():
    """What the GPU check runs, here on CPU: every variant agrees with overlap off (checked inside)."""
    report = run_on_ranks(_overlap_variants_body, 2)[0]
    names = {f"{v}{s}" for v in ("overlap_off", "overlap_2", "overlap_4", "overlap_auto", "interleave2")
             for s in ("", "_sp")}
    assert set(report["ms"]) == names | {"ceiling"} and set(report["of_ceiling"]) == names
    assert all(v > 0 for v in report["ms"].values())


def _ring_overlap_figures(out: str) -> dict:
    """``{(phase, quantity): [measured, model at overlap 1, model at the measured overlap]}``."""
    figures = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in ("forward", "backward"):
            figures[words[0], words[1]] = [float(w.rstrip("%")) for w in words[2:] if w != "ms"]
    return figures


def test_ring_overlap_benchmark_prints_every_measured_and_predicted_figure(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ring_overlap

    ring_overlap.main(["--cp", "2", "--seq-len", "16", "--batch", "1", "--heads", "2", "--kv-heads", "1",
                       "--head-dim", "4", "--rounds", "1", "--warmup", "0", "--iters", "1"])
    out = capsys.readouterr().out
    figures = _ring_overlap_figures(out)
    assert set(figures) == {(p, q) for p in ring_overlap.PHASES for q in ring_overlap.QUANTITIES}, out
    assert all(len(values) == 3 and all(math.isfinite(v) for v in values) for values in figures.values()), out
    for phase in ring_overlap.PHASES:
        assert all(v > 0 for q in ("ring", "communication", "compute") for v in figures[phase, q]), out
        assert all(0 <= v <= 100 for v in figures[phase, "hidden"]), out
    # The FLOP rate is fitted to the compute-only forward.
    measured, *predicted = figures["forward", "compute"]
    assert predicted == pytest.approx([measured, measured], abs=0.011)
    assert re.search(r"link: latency \d+\.\d+ ms, \d+\.\d+ GB/s .* overlap \d\.\d\d; .* \d+\.\d+ GFLOP/s", out), out
    assert re.search(r"1-minute load \d+\.\d before, \d+\.\d after", out), out


def test_moe_step_benchmark_reports_every_variant_against_the_plain_layer(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_step

    result = moe_step.main(["--ranks", "2", "--tokens", "16", "--hidden", "16", "--ffn", "16", "--experts", "4",
                            "--rounds", "1", "--warmup", "0", "--iters", "1"])
    assert set(result["median_ms"]) == set(result["over_plain"]) == {"plain", "EP 1", "EP 2"}
    assert all(v > 0 for v in result["median_ms"].values()) and result["over_plain"]["plain"] == 1.0
    out = capsys.readouterr().out
    assert re.search(r"1-minute load \d+\.\d before, \d+\.\d after", out), out
    assert all(re.search(rf"{name}: +\d+\.\d\d ms, \d+\.\d\d\d x plain", out) for name in result["median_ms"]), out


def test_bench_gpu_runs_both_gpu_benchmarks_at_tiny_sizes_and_prints_their_tables(capsys):
    """On a CPU (no GPU here): the same code path, the report's structure (never its timings)."""
    assert main(["bench", "--gpu", "--gpu-models", "tiny", "--gpu-decode-model", "tiny", "--gpu-steps", "1",
                 "--gpu-new-tokens", "3", "--json"]) == 0
    out = capsys.readouterr().out
    train, decode = json.loads(out[out.index("[\n"):])
    assert train["model"] == "tiny" and set(train["results"]) == {
        f"{who} {mode}" for who in ("tensorpar", "plain", "ratio") for mode in ("eager", "compiled")}
    for mode in ("eager", "compiled"):
        tensorpar, plain = train["results"][f"tensorpar {mode}"], train["results"][f"plain {mode}"]
        assert tensorpar["tokens_per_s"] > 0 and plain["tokens_per_s"] > 0
        assert train["results"][f"ratio {mode}"] == pytest.approx(tensorpar["tokens_per_s"] / plain["tokens_per_s"])
        assert math.isfinite(tensorpar["loss"]) and math.isfinite(plain["loss"])
    assert set(decode["ms_per_token"]) == {"tensorpar eager", "transformers static cache"}  # no CUDA graph on CPU
    # A per-token time is a difference of two timings: at 3 tokens on a busy CPU it may be <= 0.
    assert decode["floor_ms"] > 0 and all(math.isfinite(v) for v in decode["ms_per_token"].values())
    assert decode["tensorpar_tokens_agree"]
    assert "tensorpar / plain, compiled:" in out and "x floor" in out


def test_the_plain_gpt_of_the_gpu_benchmark_has_tensorpars_flops():
    """Equal FLOPs: the plain model's matmul weights are the count MFU uses, for both shapes."""
    from tensorpar.cli.gpu_train_bench import SHAPES, PlainGPT
    from tensorpar.models import GPTConfig
    from tensorpar.training.flops import matmul_weights

    for shape in ("tiny", "llama-1b"):
        config = GPTConfig(**{**SHAPES[shape], "num_layers": 1})
        with torch.device("meta"):
            plain = PlainGPT(config)
        weights = sum(m.weight.numel() for m in plain.modules() if isinstance(m, torch.nn.Linear))
        assert weights == matmul_weights(config), shape
