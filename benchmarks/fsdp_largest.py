"""The largest GPT each of plain DP, FSDP (ZeRO-3) and FSDP with ``reshard_after_forward=False``
(ZeRO-2-like) fits on the ranks of this machine, from the pre-launch memory estimate
(:func:`tensorpar.planning.memory.gpt_training_memory`) calibrated on small measured runs.

    python benchmarks/fsdp_largest.py [--nproc 4] [--tp 2] [--calibrate-layers 2 8]

Calibration: each variant trains (``fsdp_memory.py``'s step, 2 steps) a small GPT at each of
``--calibrate-layers`` and ``--check-layers`` on local gloo ranks; per rank, the peak RSS above
the RSS before the model is built is compared with the estimate. Per variant a line
``measured = c + k x estimate`` through the ``--calibrate-layers`` points (least squares) is the
calibration; its error is the fit's at the ``--check-layers`` points, which it has not seen.
Prediction: for the
``--hidden/--heads/--seq/--batch/--vocab`` family, the most layers whose calibrated peak, plus
the measured pre-model RSS, stays within ``MemTotal / nproc``. Nothing large is allocated.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_memory import VARIANTS, _variant  # noqa: E402  (the same three training steps)

GIB = 2 ** 30


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _measure_rank(name: str, shape: dict) -> dict:
    import tensorpar as tp

    torch.set_num_threads(1)
    tp.initialize_model_parallel(shape["tp"])
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1),
                           generator=torch.Generator().manual_seed(1 + tp.get_data_parallel_rank()))
    before = _rss()
    step, _ = _variant(name, _config(shape), tokens)
    for _ in range(2):
        float(step().detach())
    return {"before": before, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _config(shape: dict):
    from tensorpar.models import GPTConfig

    return GPTConfig(vocab_size=shape["vocab"], max_seq_len=shape["seq"], num_layers=shape["layers"],
                     num_heads=shape["heads"], hidden_size=shape["hidden"])


def estimate(name: str, shape: dict, *, nproc: int) -> float:
    from tensorpar.planning.memory import gpt_training_memory

    return gpt_training_memory(_config(shape), tp=shape["tp"], dp=nproc // shape["tp"], seq_len=shape["seq"],
                               micro_batch=shape["batch"], fsdp=name != "plain DP",
                               reshard_after_forward=name == "FSDP")["total"]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(c, k)`` of ``y = c + k x``."""
    mx, my = (sum(v) / len(points) for v in zip(*points))
    k = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - k * mx, k


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--calibrate-layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--check-layers", type=int, nargs="*", default=[5])
    parser.add_argument("--calibrate-shape", type=json.loads,
                        default={"hidden": 512, "heads": 8, "seq": 256, "batch": 2, "vocab": 8192})
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--json", help="also write the calibration points and fits to this file")
    args = parser.parse_args()
    from tensorpar.cli.launch import launch_local
    from tensorpar.planning.memory import gpt_parameters_per_rank

    points = []
    for name in VARIANTS:
        for layers in [*args.calibrate_layers, *args.check_layers]:
            shape = {**args.calibrate_shape, "layers": layers, "tp": args.tp}
            ranks = launch_local(_measure_rank, name, shape, nproc=args.nproc)
            worst = max(ranks.values(), key=lambda r: r["peak"] - r["before"])
            points.append(dict(variant=name, layers=layers, before=worst["before"], fitted=layers in args.calibrate_layers,
                               measured=worst["peak"] - worst["before"], estimate=estimate(name, shape, nproc=args.nproc)))
    fit = {name: _line([(p["estimate"], p["measured"]) for p in points if p["variant"] == name and p["fitted"]])
           for name in VARIANTS}
    before = max(p["before"] for p in points)
    print(f"calibration ({args.calibrate_shape}, TP {args.tp} x DP {args.nproc // args.tp}; MiB, largest rank):")
    print(f"{'variant':34} {'layers':>6} {'estimate':>9} {'measured':>9} {'fit':>9} {'error':>7}")
    for p in points:
        c, k = fit[p["variant"]]
        predicted = c + k * p["estimate"]
        error = "" if p["fitted"] else f"{100 * (predicted - p['measured']) / p['measured']:6.1f}%"
        print(f"{p['variant']:34} {p['layers']:6} {p['estimate'] / 2**20:9.1f} {p['measured'] / 2**20:9.1f} "
              f"{predicted / 2**20:9.1f} {error:>7}")
    for name, (c, k) in fit.items():
        print(f"{name}: measured = {c / 2**20:.1f} MiB + {k:.3f} x estimate")
    print(f"RSS before the model is built: {before / 2**20:.0f} MiB (largest)")
    if args.json:
        Path(args.json).write_text(json.dumps({"points": points, "fit": fit, "before": before}))
    budget = mem_total() / args.nproc
    family = {"hidden": args.hidden, "heads": args.heads, "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
              "tp": args.tp}
    print(f"\nlargest that fits {budget / GIB:.2f} GiB per rank (MemTotal / {args.nproc}), family {family}:")
    print(f"{'variant':34} {'layers':>6} {'params':>9} {'estimate':>9} {'calibrated':>10} {'uncalibrated':>12}")
    for name in VARIANTS:
        c, k = fit[name]

        def fits(layers, calibrated=True):
            est = estimate(name, {**family, "layers": layers}, nproc=args.nproc)
            return before + (c + k * est if calibrated else est) <= budget

        best = {}
        for calibrated in (True, False):
            layers = 0
            while fits(layers + 1, calibrated):
                layers += 1
            best[calibrated] = layers
        layers = best[True]
        shape = {**family, "layers": max(layers, 1)}
        total = gpt_parameters_per_rank(_config(shape), tp=1)
        est = estimate(name, shape, nproc=args.nproc)
        print(f"{name:34} {layers:6} {total / 1e6:8.0f}M {est / GIB:8.2f}G {(before + c + k * est) / GIB:9.2f}G "
              f"{best[False]:12}")


if __name__ == "__main__":
    main()
