"""``python -m tensorpar.cli.gpu_check``: the CUDA paths the CPU test suite cannot reach, in one command.

On a machine with one GPU it runs, in well under 5 minutes:

1. the column and row layers at TP=1 over NCCL against the unsharded computation (fp32, bf16
   autocast, fused fp32 wgrad accumulation from bf16);
2. TP=2 with both ranks on the one GPU over gloo with CUDA tensors (collectives gloo has no CUDA
   kernel for are staged through host memory): the layers in every mode, including SP (the
   global memory buffer), fusion and autocast; the CUDA RNG tracker (attention dropout forked
   per rank, replayed exactly by recompute); the GPT at TP=2 with SP, recompute and bf16
   against TP=1; a Llama-style GQA GPT at CP=2 (ring and Ulysses, recompute, bf16; its
   sends and all-to-alls staged through host memory) against CP=1;
3. a ``torch.profiler`` trace of a column layer's backward: the dgrad all-reduce in flight
   while the wgrad GEMM runs (``CUDA_DEVICE_MAX_CONNECTIONS=1``), judged from the CUDA kernels'
   intervals; saved to ``--out``;
4. the GPT-2-small training step's tokens/s and model FLOPs utilisation at TP=1;
5. at TP=2 (and over NCCL), the MLP block with its collectives chunked against the GEMMs
   (overlap 2, 4, auto), interleaved halves, with and without SP, next to the same shards' GEMMs
   with no communication (``tensorpar.cli.bench_variants.measure_overlap_variants``; results checked first);
6. greedy decode at TP=1 of a random bf16 Llama saved as a ``transformers`` directory: tensorpar's
   ``generate``, its decode step captured in a CUDA graph, and ``transformers``' ``generate``
   (static cache): the same tokens (up to near ties), and each one's ms/token
   (``tensorpar.cli.decode_check``; skipped, with a line saying so, without ``transformers``);
7. the training command as a user runs it (``tensorpar.cli.train_check``): a bf16 run saved,
   evaluated and resumed, ``generate`` and ``export --to-hf`` from it, and the invariant mode
   twice, the same losses both times.

With two or more GPUs, step 2 runs again over NCCL, one GPU per rank. ``--cpu`` runs the same
checks on CPU/gloo at small sizes (the test suite does, so all of it runs in CI). Prints one
line per check and exits non-zero if one fails.

Example::

    python -m tensorpar.cli.gpu_check --out gpu_check_out
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import DeviceType

from . import train_check
from .bench_variants import measure_overlap_variants
from .decode_check import measure_decode

# Dense bf16 peak of the GPU (FLOP/s) by name, for the utilisation; --peak-tflops overrides.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _close(actual, expected, what, tol=None):
    """Relative to the largest expected entry: sharding reorders sums (bf16 rounds partials)."""
    scale = expected.float().abs().max().clamp(min=1.0)
    torch.testing.assert_close(actual.float() / scale, expected.float() / scale, **(tol or {}),
                               msg=lambda m: f"{what}: {m}")


def check_layers(device) -> int:
    """Column and row layers (every communication mode) against one process's computation."""
    import tensorpar as tp

    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    s, b, h, out = 8 * n, 2, 32, 16 * n
    cases = 0
    for sp in ((False, True) if n > 1 else (False,)):
        for fusion in (False, True):
            for bf16 in (False, True):
                torch.manual_seed(0)
                weight, bias = torch.randn(out, h, device=device), torch.randn(out, device=device)
                x, grad = torch.randn(s, b, h, device=device), torch.randn(s, b, out, device=device)
                what = f"column tp={n} sp={sp} fusion={fusion} bf16={bf16}"
                layer = tp.ColumnParallelLinear(h, out, sequence_parallel=sp, gradient_accumulation_fusion=fusion,
                                                device=device)
                with torch.no_grad():
                    layer.weight.copy_(weight.chunk(n, 0)[r])
                    layer.bias.copy_(bias.chunk(n)[r])
                if fusion:
                    layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
                x_local = (x.chunk(n, 0)[r] if sp else x).clone().requires_grad_(True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    y, _ = layer(x_local)
                y.float().backward(grad.chunk(n, -1)[r].to(y.dtype))
                cast = (lambda t: t.bfloat16().float()) if bf16 else (lambda t: t)
                ref_y = cast(x) @ cast(weight).t() + bias
                ref_dx = cast(grad) @ cast(weight)
                ref_dw = cast(grad).reshape(-1, out).t() @ cast(x).reshape(-1, h)
                tol = BF16_TOL if bf16 else None
                _close(y, ref_y.chunk(n, -1)[r], what + " output", tol)
                _close(x_local.grad, ref_dx.chunk(n, 0)[r] if sp else ref_dx, what + " input grad", tol)
                wgrad = layer.weight.main_grad if fusion else layer.weight.grad
                _close(wgrad, ref_dw.chunk(n, 0)[r], what + " weight grad", tol)
                cases += 1
        row = tp.RowParallelLinear(out, h, input_is_parallel=True, sequence_parallel=sp, device=device)
        torch.manual_seed(1)
        weight, x = torch.randn(h, out, device=device), torch.randn(s, b, out, device=device)
        with torch.no_grad():
            row.weight.copy_(weight.chunk(n, 1)[r])
            row.bias.zero_()
        y, _ = row(x.chunk(n, -1)[r])
        ref = x @ weight.t()
        _close(y, ref.chunk(n, 0)[r] if sp else ref, f"row tp={n} sp={sp} output")
        cases += 1
    return cases


def check_rng(device) -> bool:
    """The model-parallel stream lives on the device: attention dropout differs per TP rank,
    and recompute replays it exactly."""
    import tensorpar as tp

    tp.model_parallel_manual_seed(123, device=device)
    tracker = tp.get_rng_tracker()
    q = torch.randn(1, 2, 8, 4, device=device)
    saved = tracker.get_states()
    with tracker.fork():
        first = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    tracker.set_states(saved)
    with tracker.fork():
        again = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert torch.equal(first, again), "the forked stream does not replay"
    everyone = _everyone(first)
    assert all(not torch.equal(everyone[0], other) for other in everyone[1:]), "ranks drew the same mask"
    return True


def _everyone(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (through host memory under gloo, which has no CUDA all-gather)."""
    source = t.cpu() if dist.get_backend() == "gloo" else t
    out = [torch.empty_like(source) for _ in range(dist.get_world_size())]
    dist.all_gather(out, source.contiguous())
    return out


def _own_group() -> dist.ProcessGroup:
    """A group of this rank alone (every rank creates every rank's, in one order): TP=1 or CP=1."""
    return [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]


def check_gpt(device) -> float:
    """The GPT at TP (SP, recompute, bf16 autocast) against TP=1; returns the TP loss."""
    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig, gather_full_tensor

    n = tp.get_tensor_model_parallel_world_size()
    single = _own_group()
    base = dict(vocab_size=256, max_seq_len=32, num_layers=2, num_heads=4, hidden_size=64)
    models = {}
    for name, group, extra in (("tp1", single, {}),
                               ("tp", tp.get_tensor_model_parallel_group(),
                                dict(sequence_parallel=n > 1, recompute=True))):
        tp.model_parallel_manual_seed(7, tp_group=group, device=device)
        models[name] = GPT(GPTConfig(**base, **extra), tp_group=group, device=device)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3)).to(device)
    losses = {}
    for name, model in models.items():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            losses[name] = model(tokens[:, :-1], tokens[:, 1:])
        losses[name].backward()
        tp.allreduce_sequence_parallel_grads(model, tp_group=model.tp_group)
    _close(losses["tp"], losses["tp1"], "GPT loss", BF16_TOL)
    for lay, ref in zip(models["tp"].parameter_layouts(), models["tp1"].parameter_layouts()):
        grad = lay.param.grad
        if lay.tensor_model_parallel:
            grad = gather_full_tensor(grad, partition_dim=lay.partition_dim, stride=lay.partition_stride,
                                      tp_group=models["tp"].tp_group)
        _close(grad, ref.param.grad, f"GPT grad {lay.name}", dict(rtol=5e-2, atol=5e-2))
    return float(losses["tp"].detach())


def check_context(device) -> dict:
    """A Llama-style GQA GPT over a CP group of every rank (ring and Ulysses; recompute, bf16
    autocast, a sequence the chunks pad) against CP=1: the loss and every weight gradient summed
    over CP. Returns each mode's loss."""
    import tensorpar as tp
    from tensorpar.distributed import comm
    from tensorpar.models import GPT, GPTConfig

    single = _own_group()
    cp_group = dist.new_group(list(range(dist.get_world_size())))
    config = GPTConfig(vocab_size=256, max_seq_len=32, num_layers=2, num_heads=4, num_query_groups=2, hidden_size=64,
                       norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                       tie_word_embeddings=False, recompute=True)
    tokens = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(5)).to(device)
    losses = {}
    for mode in ("p2p", "a2a"):
        steps = {}
        for name, group in (("cp1", None), ("cp", cp_group)):
            tp.model_parallel_manual_seed(11, tp_group=single, device=device)
            model = GPT(dataclasses.replace(config, context_parallel_comm=mode), tp_group=single, cp_group=group,
                        device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            steps[name] = loss.detach(), {key: p.grad for key, p in model.named_parameters()}
        (reference, reference_grads), (loss, grads) = steps["cp1"], steps["cp"]
        _close(loss, reference, f"CP {mode} loss", BF16_TOL)
        for key, grad in grads.items():
            _close(comm.all_reduce(grad, cp_group), reference_grads[key], f"CP {mode} grad {key}",
                   dict(rtol=5e-2, atol=5e-2))
        losses[mode] = float(loss)
    return losses


def profile_overlap(device, out: Path | None) -> dict:
    """Whether the column layer's dgrad all-reduce is in flight while its wgrad GEMM runs."""
    import tensorpar as tp
    from torch.profiler import ProfilerActivity, profile

    size = 2048 if device.type == "cuda" else 256
    layer = tp.ColumnParallelLinear(size, size, bias=False, device=device)
    x = torch.randn(size, 4, size, device=device, requires_grad=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(2):  # warm up (cuBLAS handles, NCCL communicators)
        layer(x)[0].sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        layer(x)[0].sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"trace_rank{dist.get_rank()}.json"))
    events = prof.events()
    # Launch order, from the host's events (on CPU also where gloo's thread works).
    reduce = [e.time_range for e in events if "allreduce" in e.name.lower().replace("_", "")]
    launched = min((t.start for t in reduce), default=None)
    mms = [e.time_range for e in events if e.name == "aten::mm"]
    order = {"dgrad_reduce_events": len(reduce),
             "gemms_after_launch": 0 if launched is None else sum(t.start > launched for t in mms)}
    return {**order, **kernel_overlap(events)}


# Device kernels: NCCL's collectives; cuBLAS/CUTLASS GEMMs (nvjet_* on H100/H200, sm90_xmma_gemm_*,
# ampere_*gemm*, cutlass*); gloo moves CUDA tensors through host memory with memcpys.
_COLLECTIVE_KERNELS = ("nccl",)
_STAGING_COPIES = ("memcpy dtoh", "memcpy htod")
_GEMM_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "gemv")


def kernel_overlap(events) -> dict:
    """Whether a GEMM kernel ran while the collective was in flight, from CUDA kernel intervals only.

    The collective is in flight from its first device activity to its last: its NCCL kernels,
    or under gloo the copies through host memory. Host-side events say when work was launched,
    not when it ran, so they are never part of the verdict; ``overlap`` is None when the
    profile holds no CUDA kernels (a CPU run).
    """
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    if not kernels:
        return {"overlap": None}

    def named(keys):
        return [e.time_range for e in kernels if any(k in e.name.lower() for k in keys)]

    collective = named(_COLLECTIVE_KERNELS) or named(_STAGING_COPIES)
    gemms = named(_GEMM_KERNELS)
    if not collective:
        return {"collective_kernels": 0, "gemm_kernels": len(gemms), "overlap": False}
    start, end = min(t.start for t in collective), max(t.end for t in collective)
    during = [t for t in gemms if t.start < end and start < t.end]
    return {"collective_kernels": len(collective), "gemm_kernels": len(gemms), "gemms_during_collective": len(during),
            "overlap": bool(during)}


def measure_throughput(device, *, preset: str, seq: int, batch: int, steps: int, peak_flops) -> dict:
    """The GPT training step (bf16 autocast, fused fp32 wgrad) at this TP size: tokens/s, MFU."""
    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig

    config = GPTConfig.preset(preset, max_seq_len=seq, gradient_accumulation_fusion=True)
    tp.model_parallel_manual_seed(0, device=device)
    model = GPT(config, device=device)
    reducer = tp.DataParallelGradReducer(model.parameters(), dp_group=tp.get_data_parallel_group())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)

    def step():
        reducer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        reducer.finish()
        tp.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    for _ in range(2):
        step()
    float(step())
    began = time.perf_counter()
    for _ in range(steps):
        loss = step()
    float(loss)
    tokens_per_s = batch * seq * steps / (time.perf_counter() - began)
    params = sum(p.numel() for p in model.parameters()) * tp.get_tensor_model_parallel_world_size()
    # Per token: 6 x parameters (forward + backward GEMMs) + attention's 12 x layers x hidden x seq.
    flops_per_token = 6 * params + 12 * config.num_layers * config.hidden_size * seq
    mfu = flops_per_token * tokens_per_s / peak_flops if peak_flops else None
    return {"tokens_per_s": tokens_per_s, "mfu": mfu, "params": params}


def _stage(kind: str, tp_size: int, device_type: str, options: dict) -> dict:
    """One launched world: initialise, run the checks of ``kind``, tear down."""
    import tensorpar as tp

    backend = options["backends"][kind]
    tp.initialize_model_parallel(tp_size, backend=backend, timeout=120)
    try:
        device = torch.device(device_type)
        if device.type == "cuda":
            device = tp.parallel_state.default_device() if backend == "nccl" else torch.device("cuda", 0)
            torch.cuda.set_device(device)
        if kind == "decode":
            return {"decode": measure_decode(device, **options["decode"])}
        results = {"layers": check_layers(device)}
        if kind != "tp1":
            results["rng"] = check_rng(device)
            results["gpt_loss"] = check_gpt(device)
            results["context"] = check_context(device)
            results["profile"] = profile_overlap(device, options["out"])
            results["overlap_variants"] = measure_overlap_variants(device, **options["overlap"])
        if kind == "tp1":
            results["throughput"] = measure_throughput(device, **options["throughput"])
        return results
    finally:
        tp.destroy_model_parallel()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorpar.cli.gpu_check", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--cpu", action="store_true", help="run every check on CPU/gloo at small sizes")
    parser.add_argument("--out", type=Path, default=None, help="directory for the profiler traces")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak")
    args = parser.parse_args(argv)
    from .launch import launch_local

    gpus = 0 if args.cpu else torch.cuda.device_count()
    if not args.cpu and gpus == 0:
        print("gpu_check: no CUDA device visible; run with --cpu for the CPU version", file=sys.stderr)
        return 2
    device_type = "cpu" if args.cpu else "cuda"
    name = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (flops for key, flops in _PEAK_BF16.items() if key in name), None)
    throughput = (dict(preset="tiny", seq=64, batch=2, steps=2, peak_flops=None) if args.cpu else
                  dict(preset="small", seq=1024, batch=8, steps=10, peak_flops=peak))
    # Two sequences: the interleaved variants split the batch (one sequence would be one part).
    overlap = (dict(hidden=64, seq=32, batch=2, dtype=torch.float32, iters=2) if args.cpu else
               dict(hidden=4096, seq=2048, batch=2, dtype=torch.bfloat16, iters=10))
    decode = (dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab=256, batch=2, prompt_len=8, new_tokens=8,
                   dtype=torch.float32, rounds=1) if args.cpu else
              dict(hidden=1024, layers=8, heads=16, kv_heads=4, vocab=32000, batch=4, prompt_len=32, new_tokens=64,
                   dtype=torch.bfloat16, rounds=3))
    single = "gloo" if args.cpu else "nccl"
    options = {"out": args.out, "throughput": throughput, "overlap": overlap, "decode": decode,
               "train": dict(steps=2, model=train_check.SMALL) if args.cpu else dict(steps=100),
               "backends": {"tp1": single, "decode": single, "shared": "gloo", "nccl": "nccl"}}
    stages = [("tp1", 1), ("decode", 1), ("train", 1), ("shared", 2)] + ([("nccl", min(gpus, 4))] if gpus >= 2 else [])
    failed = False
    print(f"gpu_check on {name}: {', '.join(f'{k} (TP={n})' for k, n in stages)}", flush=True)
    for kind, tp_size in stages:
        began = time.perf_counter()
        try:
            if kind == "train":  # the command starts its own world
                with tempfile.TemporaryDirectory() as workdir:
                    results = {"train": train_check.check_training_command(Path(workdir), **options["train"])}
            else:
                results = launch_local(_stage, kind, tp_size, device_type, options, nproc=tp_size)[0]
            line = json.dumps(results, default=str)
            failed |= "profile" in results and results["profile"]["overlap"] is False
            failed |= any(results.get(check, {}).get("ok") is False for check in ("decode", "train"))
        except Exception as exc:  # noqa: BLE001 - report every stage, then fail
            failed, line = True, f"FAILED: {exc}"
        print(f"gpu_check {kind} TP={tp_size} ({time.perf_counter() - began:.0f}s): {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
