"""The GPU check's parts on CPU (every CI run), and on CUDA where there is one (marked ``gpu``).

``python -m tensorpar.cli.gpu_check`` runs the same functions on a GPU machine; here they run on
the harness's gloo worlds with CPU tensors, so everything in it that can run on CPU does.
"""

import contextlib
import sys
import types
import unittest.mock
import warnings

import pytest
import torch

import tensorpar as tp
from tensorpar.distributed import comm
from tensorpar.cli import gpu_check, train_check
from tests.harness import run_on_ranks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _checks_body(device_type, staged):
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    device = torch.device(device_type)
    staging, staged_calls = [], []
    on_host = comm._on_host

    def on_host_once(collective, tensor, out, async_op):
        staging.append(collective)      # the collective inside runs on the host copy, unstaged
        staged_calls.append(tensor.shape)
        try:
            return on_host(collective, tensor, out, async_op)
        finally:
            staging.pop()

    with contextlib.ExitStack() as stack:
        if staged:
            stack.enter_context(unittest.mock.patch.object(comm, "_on_host", on_host_once))
            stack.enter_context(unittest.mock.patch.object(
                comm, "_staged_on_host",
                lambda op, t, g: not staging and op not in comm._GLOO_CUDA_COLLECTIVES))
        with tp.CommLedger() as ledger:
            results = {"layers": gpu_check.check_layers(device)}
        if tp.get_tensor_model_parallel_world_size() > 1:
            results["rng"] = gpu_check.check_rng(device)
            results["gpt_loss"] = gpu_check.check_gpt(device)
            results["context"] = gpu_check.check_context(device)
            results["profile"] = gpu_check.profile_overlap(device, None)
            results["overlap_variants"] = gpu_check.measure_overlap_variants(
                device, hidden=16, seq=8, batch=2, dtype=torch.float32, iters=1)
    results["gathers"] = ledger.count("all_gather")
    results["staged"] = bool(staged_calls)
    return results


def test_gpu_check_layers_at_tp1():
    assert run_on_ranks(_checks_body, 1, "cpu", False) == [{"layers": 5, "gathers": 0, "staged": False}]


@pytest.mark.parametrize("staged", [False, True], ids=["native", "staged_through_host"])
def test_gpu_check_layers_rng_gpt_context_and_overlap_at_tp2(staged):
    """TP=2 as the shared-GPU stage runs it; ``staged`` forces the host staging gloo needs
    for CUDA tensors (all-gather, reduce-scatter) onto these CPU tensors."""
    for result in run_on_ranks(_checks_body, 2, "cpu", staged):
        assert result["layers"] == 10 and result["rng"] is True and result["gathers"] > 0
        assert set(result["context"]) == {"p2p", "a2a"}
        assert result["staged"] == staged
        # The dgrad all-reduce is launched before the wgrad GEMM; whether gloo's thread is
        # still busy when the GEMM starts is up to the CPU scheduler (the GPU run asserts it).
        assert result["profile"]["dgrad_reduce_events"] and result["profile"]["gemms_after_launch"], result["profile"]
        # Chunked and interleaved variants agree with overlap off (checked inside), staged or not.
        assert len(result["overlap_variants"]["of_ceiling"]) == 10


def _event(name, start, end, device="cuda"):
    """A profiler event as ``prof.events()`` gives it (name, device type, time range in us)."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    return types.SimpleNamespace(name=name, device_type=kind, time_range=types.SimpleNamespace(start=start, end=end))


# The host launches the all-reduce and then the wgrad GEMM while the all-reduce runs: on the
# host's clock they always "overlap", whatever the GPU then does.
LAUNCHES = [_event("c10d::allreduce_", 10, 12, "cpu"), _event("aten::mm", 13, 14, "cpu")]
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
NVJET = "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT"   # cuBLAS on H100/H200


class _FakeProfile:
    """``torch.profiler.profile`` answering with ``events`` (the suite has no CUDA kernels)."""

    events_to_give: list = []

    def __init__(self, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def events(self):
        return self.events_to_give


def _verdict_body(events):
    tp.initialize_model_parallel(1)
    _FakeProfile.events_to_give = events
    with unittest.mock.patch("torch.profiler.profile", _FakeProfile):
        return gpu_check.profile_overlap(torch.device("cpu"), None)["overlap"]


def test_overlap_verdict_comes_from_cuda_kernel_intervals_only():
    """Issue 16 item 6: host launch events made serialized kernels pass, and ``nvjet_*`` GEMMs
    (cuBLAS on H100/H200) were not recognised."""
    serialized = LAUNCHES + [_event(NCCL, 20, 30), _event(NVJET, 31, 40)]
    overlapped = LAUNCHES + [_event(NCCL, 20, 30), _event(NVJET, 25, 35)]
    assert run_on_ranks(_verdict_body, 1, serialized) == [False]
    assert run_on_ranks(_verdict_body, 1, overlapped) == [True]
    for gemm in ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "ampere_sgemm_128x64_tn",
                 "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(Params)"):
        assert gpu_check.kernel_overlap([_event(NCCL, 0, 10), _event(gemm, 5, 12)])["overlap"] is True, gemm
    # Gloo with CUDA tensors: in flight from the copy to host memory to the copy back.
    staged = [_event("Memcpy DtoH (Device -> Pinned)", 20, 21), _event("Memcpy HtoD (Pinned -> Device)", 40, 41)]
    assert gpu_check.kernel_overlap(staged + [_event(NVJET, 25, 35)])["overlap"] is True
    assert gpu_check.kernel_overlap(staged + [_event(NVJET, 42, 50)])["overlap"] is False
    assert gpu_check.kernel_overlap(LAUNCHES) == {"overlap": None}   # a CPU run: nothing to judge


def _throughput_body():
    tp.initialize_model_parallel(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. float() of a loss that still requires grad
        return gpu_check.measure_throughput(torch.device("cpu"), preset="tiny", seq=32, batch=2, steps=1,
                                            peak_flops=1e12)


def test_gpu_check_throughput_reports_tokens_per_second_and_mfu():
    (result,) = run_on_ranks(_throughput_body, 1)
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1


DECODE_FIELDS = {"model", "batch", "prompt_len", "new_tokens", "transformers_cache", "cuda_graph",
                 "transformers_ms_per_token", "tensorpar_ms_per_token", "tensorpar_graph_ms_per_token", "graph_step_ms",
                 "ratio", "graph_ratio", "tokens", "ok"}


def _decode_body():
    tp.initialize_model_parallel(1)
    return gpu_check.measure_decode(torch.device("cpu"), hidden=64, layers=2, heads=4, kv_heads=2, vocab=256, batch=2,
                                    prompt_len=8, new_tokens=8, dtype=torch.float32, rounds=1)


def test_gpu_check_decode_stage_matches_transformers_tokens_and_reports_every_field():
    """Issue 20: tensorpar's decode and its fixed-shape step (the CUDA graph's, eager here)
    choose transformers' tokens on the same saved Llama; the report has every figure."""
    pytest.importorskip("transformers")
    (result,) = run_on_ranks(_decode_body, 1)
    assert set(result) == DECODE_FIELDS, result
    assert result["ok"] and result["cuda_graph"] is False
    # fp32 on CPU: every sequence equal, no near tie needed.
    assert result["tokens"] == {name: {"equal": 2, "near_ties": 0, "differ": []}
                                for name in ("tensorpar", "tensorpar_graph")}
    # Timings are figures, not assertions (a loaded machine may move them anywhere).
    assert all(isinstance(result[key], float) for key in DECODE_FIELDS if key.endswith(("_ms", "_token", "ratio")))


def test_decode_stage_says_it_is_skipped_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers raises ImportError
    result = gpu_check.measure_decode(torch.device("cpu"), hidden=64, layers=2, heads=4, kv_heads=2, vocab=256,
                                      batch=2, prompt_len=8, new_tokens=8, dtype=torch.float32, rounds=1)
    assert set(result) == {"skipped"} and "transformers is not installed" in result["skipped"]


def test_decode_tokens_may_differ_from_the_reference_only_at_a_near_tie():
    from tensorpar.cli.decode_check import agreement

    reference = torch.tensor([[9, 1, 2, 3], [9, 1, 2, 3], [9, 1, 2, 3]])
    logits = [torch.tensor([[5.0, 10.0, 0.0, 0.0]] * 3), torch.tensor([[0.0, 0.0, 10.0, 9.9]] * 3),
              torch.tensor([[0.0, 0.0, 0.0, 10.0]] * 3)]
    tokens = torch.tensor([[9, 1, 2, 3],          # equal
                           [9, 1, 3, 0],          # first differs at a near tie (9.9 vs 10), then anything
                           [9, 0, 2, 3]])         # differs where the reference's margin is 5
    assert agreement(tokens, reference, logits, prompt_len=1) == {"equal": 1, "near_ties": 1,
                                                                  "differ": [(2, 0, 5.0, 10.0)]}


def _train_check_body(workdir):
    from pathlib import Path

    return train_check.check_training_command(Path(workdir), steps=2, model=train_check.SMALL)


@pytest.mark.slow
def test_gpu_check_train_stage_runs_the_commands_a_user_runs(tmp_path):
    """A bf16 run saved and resumed, generate and export from it, the invariant mode twice: what
    found that ``tensorpar train`` did not start on the GPU machine's torch."""
    pytest.importorskip("transformers")
    (result,) = run_on_ranks(_train_check_body, 1, str(tmp_path))
    assert result["ok"] and len(result["invariant_losses"]) == 2, result  # steps 1 and 2
    assert result["generated"].startswith("def "), result
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(result["export"]), result
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_4"  # resumed to 2 x steps


def test_a_failing_command_of_the_train_stage_raises_with_its_status_and_last_line():
    with pytest.raises(RuntimeError, match=r"^tensorpar train --hidden 66 --heads 4 exited 2: "
                                           r"tensorpar train: error: .*66"):
        train_check._tensorpar("train", "--hidden", "66", "--heads", "4")


def test_the_train_stage_skips_the_export_without_the_hf_extra(tmp_path, monkeypatch):
    for name in ("transformers", "safetensors"):
        monkeypatch.setitem(sys.modules, name, None)  # importlib finds no spec for it
    ran = []
    monkeypatch.setattr(train_check, "_tensorpar", lambda *argv: ran.append(argv[0]) or "def x\n")
    monkeypatch.setattr(train_check, "_losses", lambda run: [5.0, 4.0])
    result = train_check.check_training_command(tmp_path, steps=1)
    assert result["export"] == "skipped: transformers and safetensors not installed" and "export" not in ran
    assert ran == ["train", "train", "generate", "train", "train"] and result["ok"]


@pytest.mark.gpu
@cuda
def test_gpu_check_command_on_this_gpu(tmp_path):
    """The whole command on the GPU (NCCL at TP=1, two ranks sharing it over gloo, ...)."""
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert list(tmp_path.glob("trace_rank*.json"))


@pytest.mark.gpu
@cuda
def test_fused_wgrad_accumulation_on_this_gpu_matches_the_upcast_path(monkeypatch):
    """Whatever the probe finds on this GPU and torch, main_grad is the exact fp32 sum."""
    from tensorpar.tensor_parallel import linear_function as linear

    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        x, grad = torch.randn(64, 2, 32, device="cuda").to(dtype), torch.randn(64, 2, 48, device="cuda").to(dtype)
        main_grads = []
        for forced in (None, False):
            monkeypatch.setattr(linear, "_FUSED_ADDMM_SUPPORTED", {} if forced is None else {("cuda", dtype): forced})
            weight = torch.nn.Parameter(torch.randn(48, 32, device="cuda"))
            weight.main_grad = torch.full((48, 32), 1.0 + 2.0 ** -12, device="cuda")
            linear.compute_weight_grad(weight, x, grad, gradient_accumulation_fusion=True)
            main_grads.append(weight.main_grad)
        exact = grad.reshape(-1, 48).double().t() @ x.reshape(-1, 32).double() + 1.0 + 2.0 ** -12
        for main_grad in main_grads:
            torch.testing.assert_close(main_grad.double(), exact, rtol=1e-6, atol=1e-5, msg=lambda m: f"{dtype}: {m}")
