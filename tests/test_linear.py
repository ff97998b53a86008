"""Column/row parallel linear layers against the unsharded computation, every mode, TP = 1, 2, 4.

Each case builds the full weight, bias, input and output gradient with plain torch (same seed
on every rank), loads this rank's shard into the layer, runs forward and backward, and
compares the output, the input gradient and every weight/bias gradient shard with the
corresponding slice of the unsharded result.
"""

import itertools
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensorpar as tp
from tensorpar.tensor_parallel.initialization import init_method_normal, init_weight_shard, shard_rows
from tensorpar.models import gather_full_tensor
from tests.harness import run_on_ranks

S, B, IN, OUT = 8, 2, 12, 16
BF16_TOL = dict(rtol=1.6e-2, atol=2e-2)  # bf16 keeps 8 mantissa bits; values here are O(1..5)


def _close(actual, expected, case, what, dtype=torch.float32):
    tol = BF16_TOL if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(actual.float(), expected.float(), **tol,
                               msg=lambda m: f"{what} mismatch for {case}:\n{m}")


def _full_problem(seed, dtype):
    """Full weight [OUT, IN], bias, input [S, B, IN], output grad [S, B, OUT], rounded to dtype."""
    torch.manual_seed(seed)
    tensors = torch.randn(OUT, IN), torch.randn(OUT), torch.randn(S, B, IN), torch.randn(S, B, OUT)
    return [t.to(dtype) for t in tensors]


def _reference(weight, bias, x, grad, *, with_bias=True):
    wf, bf, xf, gf = (t.float() for t in (weight, bias, x, grad))
    out = xf @ wf.t() + (bf if with_bias else 0)
    return out, gf @ wf, gf.reshape(-1, gf.shape[-1]).t() @ xf.reshape(-1, xf.shape[-1]), gf.sum((0, 1))


def _attach_main_grad(layer):
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)


def _results(out, x_local, layer):
    """What a case computed, for comparing the chunked path with the unchunked one."""
    weight_grad = layer.weight.main_grad if hasattr(layer.weight, "main_grad") else layer.weight.grad
    return {"output": out.detach(), "input grad": x_local.grad, "weight grad": weight_grad,
            "bias grad": layer.bias.grad}


def _column_case(n, r, *, sp, gather_output, skip_bias_add, fusion, allreduce_dgrad, dtype, mode, overlap):
    case = dict(tp=n, sp=sp, gather_output=gather_output, skip_bias_add=skip_bias_add, fusion=fusion,
                allreduce_dgrad=allreduce_dgrad, dtype=dtype, mode=mode, overlap=overlap)
    weight, bias, x, grad = _full_problem(1, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SP at TP=1 warns; covered by its own test
        layer = tp.ColumnParallelLinear(
            IN, OUT, sequence_parallel=sp, gather_output=gather_output, skip_bias_add=skip_bias_add,
            gradient_accumulation_fusion=fusion, allreduce_dgrad=allreduce_dgrad, params_dtype=dtype,
            is_expert=mode == "expert", disable_grad_reduce=mode == "disable_grad_reduce",
            defer_wgrad_compute=mode in ("defer", "defer_limit"),
            wgrad_deferral_limit=1 if mode == "defer_limit" else 0, overlap=overlap)
    with torch.no_grad():
        layer.weight.copy_(weight.chunk(n, 0)[r])
        layer.bias.copy_(bias.chunk(n)[r])
    if mode == "frozen":
        layer.weight.requires_grad_(False)
    if fusion:
        _attach_main_grad(layer)
    # disable_grad_reduce drops the dgrad all-reduce only; SP's reduce-scatter stays.
    local_comm = n > 1 and (mode == "expert" or (mode == "disable_grad_reduce" and not sp))
    sp_input = sp and not (mode == "expert" and n > 1)
    x_local = (x.chunk(n, 0)[r] if sp_input else x).clone().requires_grad_(True)
    grad_local = grad if gather_output else grad.chunk(n, -1)[r]
    micro_batches = 2 if mode == "defer_limit" or fusion else 1
    for _ in range(micro_batches):
        out, returned_bias = layer(x_local)
        if skip_bias_add:
            assert returned_bias is layer.bias, case
            if not gather_output:
                out = out + returned_bias
        else:
            assert returned_bias is None, case
        out.backward(grad_local)
    with_bias = not (skip_bias_add and gather_output)
    ref_out, ref_dx, ref_dw, ref_db = _reference(weight, bias, x, grad, with_bias=with_bias)
    if local_comm:
        # No TP communication at all: the rank computes with its shard only.
        w_r = weight.chunk(n, 0)[r]
        x_in = x_local.detach()
        out_exp, dx_exp, dw_exp, _ = _reference(w_r, bias.chunk(n)[r], x_in, grad_local)
        _close(out, out_exp, case, "output", dtype)
        _close(x_local.grad, dx_exp * micro_batches, case, "input grad", dtype)
        _close(layer.weight.grad, dw_exp * micro_batches, case, "weight grad", dtype)
        return _results(out, x_local, layer)
    _close(out, ref_out if gather_output else ref_out.chunk(n, -1)[r], case, "output", dtype)
    _close(x_local.grad, (ref_dx.chunk(n, 0)[r] if sp else ref_dx) * micro_batches, case, "input grad", dtype)
    dw_exp = ref_dw.chunk(n, 0)[r]
    if mode == "frozen":
        assert layer.weight.grad is None, case
    elif mode == "defer":
        assert layer.weight.grad is None, case
        layer.compute_deferred_wgrads()
        _close(layer.weight.grad, dw_exp, case, "deferred weight grad", dtype)
    elif mode == "defer_limit":
        # The first micro-batch's wgrad was deferred, the second computed in backward.
        _close(layer.weight.grad, dw_exp, case, "in-backward weight grad", dtype)
        layer.compute_deferred_wgrads()
        _close(layer.weight.grad, dw_exp * 2, case, "weight grad after deferred", dtype)
    elif fusion:
        assert layer.weight.grad is None, case
        # fp32 accumulation of the bf16 products: checked at fp32 precision.
        _close(layer.weight.main_grad, dw_exp * micro_batches, case, "main_grad")
    else:
        _close(layer.weight.grad, dw_exp, case, "weight grad", dtype)
    if with_bias:
        _close(layer.bias.grad, ref_db.chunk(n)[r] * micro_batches, case, "bias grad", dtype)
    else:
        assert layer.bias.grad is None, case
    return _results(out, x_local, layer)


def _row_case(n, r, *, sp, input_is_parallel, skip_bias_add, fusion, dtype, mode, overlap):
    case = dict(tp=n, sp=sp, input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add, fusion=fusion,
                dtype=dtype, mode=mode, overlap=overlap)
    weight, bias, x, grad = _full_problem(2, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = tp.RowParallelLinear(IN, OUT, sequence_parallel=sp, input_is_parallel=input_is_parallel,
                                     skip_bias_add=skip_bias_add, gradient_accumulation_fusion=fusion,
                                     params_dtype=dtype, is_expert=mode == "expert", overlap=overlap)
    with torch.no_grad():
        layer.weight.copy_(weight.chunk(n, 1)[r])
        layer.bias.copy_(bias)
    if mode == "frozen":
        layer.weight.requires_grad_(False)
    if fusion:
        _attach_main_grad(layer)
    x_local = (x.chunk(n, -1)[r] if input_is_parallel else x).clone().requires_grad_(True)
    expert_local = mode == "expert" and n > 1
    grad_local = grad.chunk(n, 0)[r] if sp and not expert_local else grad
    out, returned_bias = layer(x_local)
    if skip_bias_add:
        assert returned_bias is layer.bias, case
        out = out + returned_bias
    out.backward(grad_local)
    if getattr(layer.bias, "sequence_parallel", False):
        tp.allreduce_sequence_parallel_grads(layer)
    ref_out, ref_dx, ref_dw, ref_db = _reference(weight, bias, x, grad)
    if expert_local:
        out_exp, dx_exp, dw_exp, db_exp = _reference(weight.chunk(n, 1)[r], bias, x_local.detach(), grad_local)
        _close(out, out_exp, case, "output", dtype)
        _close(x_local.grad, dx_exp, case, "input grad", dtype)
        _close(layer.weight.grad, dw_exp, case, "weight grad", dtype)
        return _results(out, x_local, layer)
    assert getattr(layer.bias, "sequence_parallel", False) == (sp and n > 1), case
    _close(out, ref_out.chunk(n, 0)[r] if sp else ref_out, case, "output", dtype)
    _close(x_local.grad, ref_dx.chunk(n, -1)[r] if input_is_parallel else ref_dx, case, "input grad", dtype)
    dw_exp = ref_dw.chunk(n, 1)[r]
    if mode == "frozen":
        assert layer.weight.grad is None, case
    elif fusion:
        assert layer.weight.grad is None, case
        _close(layer.weight.main_grad, dw_exp, case, "main_grad")
    else:
        _close(layer.weight.grad, dw_exp, case, "weight grad", dtype)
    _close(layer.bias.grad, ref_db, case, "bias grad", dtype)
    return _results(out, x_local, layer)


DTYPES = (torch.float32, torch.bfloat16)
# 3 chunks: uneven splits of S=8 rows (3+3+2) and of a rank's SP slice (2+1+1 at TP=2; at TP=4
# its 2 rows cap it at 2 chunks).
CHUNKS = 3


def _check_chunked(case_fn, chunked_keys, **case):
    """Run ``case_fn`` unchunked and chunked (each checked against the unsharded computation).

    ``chunked_keys`` are the results a chunked pipeline computes: a GEMM over fewer rows (or a
    batched one) may run another kernel, and a chunk's reduction may add the ranks' partials in
    another order, so they agree to rounding (a few units in the last place of the largest
    value). Every other result is the same operation on the same data in both runs: equal bits.
    """
    unchunked, chunked = case_fn(overlap="off", **case), case_fn(overlap=CHUNKS, **case)
    for key, value in unchunked.items():
        assert (chunked[key] is None) == (value is None), (key, case)
        if value is None:
            continue
        if key in chunked_keys:
            eps = torch.finfo(value.dtype).eps
            scale = max(value.abs().max().item(), 1.0)
            torch.testing.assert_close(chunked[key], value, rtol=0, atol=4 * eps * scale,
                                       msg=lambda m: f"{key}: chunked differs from unchunked for {case}:\n{m}")
        else:
            assert torch.equal(value, chunked[key]), f"{key}: chunked differs from unchunked for {case}"


# What the chunked pipelines compute, where a layer chunks at all (more than one rank and a TP
# collective on its critical path). Column: the SP forward (all-gather against the GEMM) and the
# dgrad reduction. Row: the exit reduction and, under SP, the dgrad (output-grad all-gather
# against the GEMM). The wgrad is one GEMM over the same gathered rows either way.
def _column_chunked(n, *, sp, allreduce_dgrad, mode, **_):
    reduces_dgrad = allreduce_dgrad and mode not in ("expert", "disable_grad_reduce")
    if n == 1 or not (sp and mode != "expert" or reduces_dgrad):
        return set()
    return {"input grad", "output"} if sp else {"input grad"}


def _row_chunked(n, *, sp, mode, **_):
    if n == 1 or mode == "expert":
        return set()
    return {"output", "input grad"} if sp else {"output"}


def _column_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    count = 0
    for sp, gather_output, skip, fusion, allreduce_dgrad, dtype in itertools.product(
            (False, True), (False, True), (False, True), (False, True), (True, False), DTYPES):
        if sp and gather_output:
            continue
        case = dict(sp=sp, gather_output=gather_output, skip_bias_add=skip, fusion=fusion,
                    allreduce_dgrad=allreduce_dgrad, dtype=dtype, mode="plain")
        _check_chunked(_column_case, _column_chunked(n, **case), n=n, r=r, **case)
        count += 1
    for mode, sp, dtype in itertools.product(
            ("defer", "defer_limit", "frozen", "expert", "disable_grad_reduce"), (False, True), DTYPES):
        case = dict(sp=sp, gather_output=False, skip_bias_add=False, fusion=False, allreduce_dgrad=True,
                    dtype=dtype, mode=mode)
        _check_chunked(_column_case, _column_chunked(n, **case), n=n, r=r, **case)
        count += 1
    return count


def _row_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    count = 0
    for sp, input_is_parallel, skip, fusion, dtype in itertools.product(
            (False, True), (True, False), (False, True), (False, True), DTYPES):
        if sp and not input_is_parallel:
            continue
        case = dict(sp=sp, input_is_parallel=input_is_parallel, skip_bias_add=skip, fusion=fusion, dtype=dtype,
                    mode="plain")
        _check_chunked(_row_case, _row_chunked(n, **case), n=n, r=r, **case)
        count += 1
    for mode, sp, dtype in itertools.product(("frozen", "expert"), (False, True), DTYPES):
        case = dict(sp=sp, input_is_parallel=True, skip_bias_add=False, fusion=False, dtype=dtype, mode=mode)
        _check_chunked(_row_case, _row_chunked(n, **case), n=n, r=r, **case)
        count += 1
    return count


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.slow
def test_column_parallel_linear_matches_unsharded(world_size):
    counts = run_on_ranks(_column_body, world_size)
    assert counts == [counts[0]] * world_size and counts[0] == 68


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_row_parallel_linear_matches_unsharded(world_size):
    counts = run_on_ranks(_row_body, world_size)
    assert counts == [counts[0]] * world_size and counts[0] == 32


def _autocast_body():
    """fp32 parameters under bf16 autocast: bf16 compute, fp32 gradients."""
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    weight, bias, x, grad = _full_problem(3, torch.float32)
    layer = tp.ColumnParallelLinear(IN, OUT)
    with torch.no_grad():
        layer.weight.copy_(weight.chunk(n, 0)[r])
        layer.bias.copy_(bias.chunk(n)[r])
    x_local = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(x_local)
    assert out.dtype == torch.bfloat16
    out.backward(grad.chunk(n, -1)[r].to(torch.bfloat16))
    assert layer.weight.grad.dtype == torch.float32 and x_local.grad.dtype == torch.float32
    ref_out, ref_dx, ref_dw, ref_db = _reference(*(t.to(torch.bfloat16) for t in (weight, bias, x, grad)))
    case = "autocast"
    _close(out, ref_out.chunk(n, -1)[r], case, "output", torch.bfloat16)
    _close(x_local.grad, ref_dx, case, "input grad", torch.bfloat16)
    _close(layer.weight.grad, ref_dw.chunk(n, 0)[r], case, "weight grad", torch.bfloat16)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_autocast_bf16_with_fp32_parameters(world_size):
    assert all(run_on_ranks(_autocast_body, world_size))


def _pair_ledger_body(sp, overlap="off"):
    """A column + row pair (an MLP block): the collectives each phase issues."""
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    fc1 = tp.ColumnParallelLinear(IN, OUT, sequence_parallel=sp, overlap=overlap)
    fc2 = tp.RowParallelLinear(OUT, IN, input_is_parallel=True, sequence_parallel=sp, overlap=overlap)
    x = torch.randn(S // n if sp else S, B, IN, requires_grad=True)
    with tp.CommLedger() as ledger:
        with ledger.phase("forward"):
            y, _ = fc2(torch.nn.functional.gelu(fc1(x)[0]))
        with ledger.phase("backward"):
            y.sum().backward()
    return [(rec.phase, rec.op, rec.shape, rec.bytes, rec.async_op) for rec in ledger.records]


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_row_pair_issues_one_allreduce_each_way(world_size):
    records = run_on_ranks(_pair_ledger_body, world_size, False)[0]
    full = (S, B, IN)
    nbytes = S * B * IN * 4
    assert records == [("forward", "all_reduce", full, nbytes, False),
                       ("backward", "all_reduce", full, nbytes, True)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_row_pair_under_sp_issues_gathers_and_reduce_scatters(world_size):
    records = run_on_ranks(_pair_ledger_body, world_size, True)[0]
    full = (S, B, IN)
    nbytes = S * B * IN * 4
    assert records == [
        ("forward", "all_gather", full, nbytes, False),       # column input, sequence gathered
        ("forward", "reduce_scatter", full, nbytes, False),   # row output, g under SP
        ("backward", "all_gather", full, nbytes, False),      # row output grad
        ("backward", "all_gather", full, nbytes, True),       # column input re-gathered for wgrad
        ("backward", "reduce_scatter", full, nbytes, True),   # column dgrad, overlapped with wgrad
    ]


@pytest.mark.parametrize("world_size", [2, 4])
def test_chunked_pair_issues_each_collective_in_chunks(world_size):
    """overlap=2: every collective on the critical path becomes two of half the sequence."""
    half = (S // 2, B, IN)
    nbytes = S // 2 * B * IN * 4
    chunk = lambda phase, op: [(phase, op, half, nbytes, True)] * 2  # noqa: E731
    assert run_on_ranks(_pair_ledger_body, world_size, False, 2)[0] == [
        *chunk("forward", "all_reduce"),           # row output, against the row GEMM
        *chunk("backward", "all_reduce")]          # column dgrad, against the dgrad GEMM
    assert run_on_ranks(_pair_ledger_body, world_size, True, 2)[0] == [
        *chunk("forward", "all_gather"),           # column input, against the column GEMM
        *chunk("forward", "reduce_scatter"),       # row output, against the row GEMM
        *chunk("backward", "all_gather"),          # row output grad, against the row dgrad GEMM
        ("backward", "all_gather", (S, B, IN), S * B * IN * 4, True),  # column input for wgrad
        *chunk("backward", "reduce_scatter")]      # column dgrad, against the dgrad GEMM


def test_single_rank_issues_no_collectives():
    assert run_on_ranks(_pair_ledger_body, 1, False) == [[]]
    assert run_on_ranks(_pair_ledger_body, 1, False, 4) == [[]]


def _gather_output_ledger_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    layer = tp.ColumnParallelLinear(IN, OUT, gather_output=True)
    x = torch.randn(S, B, IN, requires_grad=True)
    with tp.CommLedger() as ledger:
        with ledger.phase("forward"):
            y, _ = layer(x)
        with ledger.phase("backward"):
            y.sum().backward()
    return [(rec.phase, rec.op, rec.shape, rec.bytes) for rec in ledger.records]


def test_column_gather_output_issues_allgather_forward_allreduce_backward():
    assert run_on_ranks(_gather_output_ledger_body, 2)[0] == [
        ("forward", "all_gather", (S, B, OUT), S * B * OUT * 4),
        ("backward", "all_reduce", (S, B, IN), S * B * IN * 4)]


def _bad_input_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    # Sizes TP does not divide split as evenly as possible (each of the stride blocks alike).
    assert tp.ColumnParallelLinear(8, 10).partition_sizes == [3, 3, 2, 2]
    assert tp.RowParallelLinear(6, 8).partition_sizes == [2, 2, 1, 1]
    rank = tp.get_tensor_model_parallel_rank()
    assert tp.ColumnParallelLinear(8, 12, stride=2).weight.shape[0] == 2 * [2, 2, 1, 1][rank]
    assert tp.ColumnParallelLinear(8, 16).partition_sizes is None  # the equal split: today's path
    with pytest.raises(ValueError, match=r"output_size 13 is not divisible by stride 2"):
        tp.ColumnParallelLinear(8, 13, stride=2)
    layer = tp.ColumnParallelLinear(8, 16)
    with pytest.raises(ValueError, match=r"input feature size 7 does not match the weight's input size 8"):
        layer(torch.randn(2, 1, 7))
    with pytest.raises(ValueError, match=r"input dtype torch.bfloat16 differs from weight dtype torch.float32"):
        layer(torch.randn(2, 1, 8, dtype=torch.bfloat16))
    fused = tp.ColumnParallelLinear(8, 16, gradient_accumulation_fusion=True)
    with pytest.raises(ValueError, match=r"needs weight.main_grad"):
        fused(torch.randn(2, 1, 8))
    sp = tp.ColumnParallelLinear(8, 16, sequence_parallel=True)
    row_sp = tp.RowParallelLinear(16, 8, sequence_parallel=True, input_is_parallel=True)
    with pytest.raises(ValueError, match=r"\(6\) is not divisible by the tensor-parallel size \(4\)"):
        row_sp(sp(torch.randn(6, 1, 8))[0][:6])
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        tp.RowParallelLinear(16, 8, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"RowParallelLinear: overlap must be 'off', 'auto' or a positive number of "
                                         r"chunks, got 0"):
        tp.RowParallelLinear(16, 8, overlap=0)
    with pytest.raises(ValueError, match="gather_output=True cannot be combined with sequence_parallel"):
        tp.ColumnParallelLinear(8, 16, sequence_parallel=True, gather_output=True)
    with pytest.raises(ValueError, match=r"the weight passed to forward has shape \[16, 8\], expected \[4, 8\]"):
        layer(torch.randn(2, 1, 8), weight=torch.randn(16, 8))
    return True


def test_bad_input_gets_clear_errors():
    assert all(run_on_ranks(_bad_input_body, 4))


def test_layer_before_initialize_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel"):
        tp.ColumnParallelLinear(4, 4)


def _sp_single_rank_body():
    tp.initialize_model_parallel(1)
    with pytest.warns(UserWarning, match="sequence_parallel=True with one tensor-parallel rank"):
        layer = tp.ColumnParallelLinear(4, 4, sequence_parallel=True)
    assert layer.sequence_parallel is False
    return True


def test_sequence_parallel_with_one_rank_warns_and_turns_off():
    assert run_on_ranks(_sp_single_rank_body, 1) == [True]


def _explicit_group_body():
    """Layers on an explicit tp_group, without initialize_model_parallel."""
    rank = torch.distributed.get_rank()
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    group = groups[rank // 2]
    weight, bias, x, grad = _full_problem(4, torch.float32)
    layer = tp.ColumnParallelLinear(IN, OUT, tp_group=group, gather_output=True)
    with torch.no_grad():
        layer.weight.copy_(weight.chunk(2, 0)[rank % 2])
        layer.bias.copy_(bias.chunk(2)[rank % 2])
    out, _ = layer(x)
    ref_out = _reference(weight, bias, x, grad)[0]
    _close(out, ref_out, "explicit group", "output")
    return True


def test_explicit_tp_group_without_global_state():
    assert all(run_on_ranks(_explicit_group_body, 4))


def _autocast_sp_ledger_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    layer = tp.ColumnParallelLinear(IN, OUT, sequence_parallel=True)
    x = torch.randn(S // n, B, IN, requires_grad=True)
    with tp.CommLedger() as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(x)
        out.float().sum().backward()
    return [(rec.op, rec.dtype, rec.bytes) for rec in ledger.records]


def test_sp_gathers_travel_in_the_autocast_dtype():
    nbytes = S * B * IN * 2
    assert run_on_ranks(_autocast_sp_ledger_body, 2)[0] == [
        ("all_gather", torch.bfloat16, nbytes), ("all_gather", torch.bfloat16, nbytes),
        ("reduce_scatter", torch.bfloat16, nbytes)]


# ----------------------------------------------------------- fused fp32 wgrad accumulation

def _addmm_variant(name, calls):
    """Emulations of ``torch.addmm`` across torch versions and devices (the real one on CPU
    has no ``out_dtype`` kernel at all)."""
    real = torch.addmm

    def addmm(self, mat1, mat2, *, out_dtype=None, out=None, **kwargs):
        if out_dtype is None:
            return real(self, mat1, mat2, out=out, **kwargs) if out is not None else real(self, mat1, mat2, **kwargs)
        if name == "no_overload":        # torch < 2.8
            raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")
        if name == "rejects_fp32_self":  # torch 2.8 / 2.9 on CUDA
            raise RuntimeError("self and mat2 must have the same dtype, but got Float and BFloat16")
        calls.append(out)
        assert out_dtype == torch.float32 and mat1.dtype == mat2.dtype == torch.bfloat16
        # "rounds_self" stands for any kernel that does not keep self's fp32 bits.
        base = self.to(torch.bfloat16).float() if name == "rounds_self" else self
        return out.copy_(base + mat1.float() @ mat2.float())

    return addmm


@pytest.mark.parametrize("variant, fused", [("cpu", False), ("no_overload", False), ("rejects_fp32_self", False),
                                            ("rounds_self", False), ("fp32_out", True)])
def test_fused_wgrad_accumulation_probes_addmm_and_stays_exact(monkeypatch, variant, fused):
    """Item 1: addmm's out_dtype overload is used only where a probe finds it correct; every
    branch sums bf16 products into the fp32 main_grad exactly."""
    from tensorpar.tensor_parallel import linear_function as linear

    monkeypatch.setattr(linear, "_FUSED_ADDMM_SUPPORTED", {})
    calls = []
    if variant != "cpu":
        monkeypatch.setattr(torch, "addmm", _addmm_variant(variant, calls))
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(OUT, IN))
    weight.main_grad = torch.full((OUT, IN), 1.0 + 2.0 ** -12)
    x, grad = torch.randn(S, B, IN).bfloat16(), torch.randn(S, B, OUT).bfloat16()
    for _ in range(2):
        assert linear.compute_weight_grad(weight, x, grad, gradient_accumulation_fusion=True) is None
    assert linear.fused_addmm_supported(torch.device("cpu"), torch.bfloat16) is fused
    assert sum(out is weight.main_grad for out in calls) == (2 if fused else 0)
    exact = grad.reshape(-1, OUT).double().t() @ x.reshape(-1, IN).double()
    torch.testing.assert_close(weight.main_grad.double(), 1.0 + 2.0 ** -12 + 2 * exact, rtol=1e-6, atol=1e-5)


def _precision_flags() -> tuple[str, str]:
    """torch's fp32 GEMM precision settings, read through the new API only (reading the legacy
    ``allow_tf32`` raises once the new one was set)."""
    return torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision


class _FlagsAtGemms(TorchDispatchMode):
    """Records, at every GEMM, torch's fp32 GEMM precision settings then."""

    def __init__(self):
        super().__init__()
        self.flags = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.mm):
            self.flags.append(_precision_flags())
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tf32_set_by_the_new_api():
    """What PyTorch now recommends a program do: set TF32 through ``fp32_precision``."""
    previous = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    yield
    torch.backends.cuda.matmul.fp32_precision = previous


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_wgrad_fallback_is_exact_and_leaves_the_precision_flags_alone(monkeypatch, tf32_set_by_the_new_api,
                                                                             dtype):
    """Without addmm's out_dtype kernel (CPU; CUDA torch < 2.10) the upcast operands are multiplied
    at the program's own fp32 precision: exact, as bf16 and fp16 values are TF32 numbers. After a
    program set TF32 through the new API, a fused layer's wgrad runs (the legacy flag is never read)
    and no global flag changes, during backward or after. The probe is asked per device type and dtype."""
    from tensorpar.tensor_parallel import linear_function as linear

    probed = []
    monkeypatch.setattr(linear, "_FUSED_ADDMM_SUPPORTED", {})
    monkeypatch.setattr(linear, "_probe_fused_addmm", lambda device, dt: probed.append((device.type, dt)) or False)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(OUT, IN, dtype=dtype))
    weight.main_grad = torch.full((OUT, IN), 1.0 + 2.0 ** -12)
    x, grad = torch.randn(S, B, IN).to(dtype), torch.randn(S, B, OUT).to(dtype)
    flags_before = _precision_flags()
    with _FlagsAtGemms() as spy:  # the wgrad step of a fused layer's backward
        linear.compute_weight_grad(weight, x, grad, gradient_accumulation_fusion=True)
    assert spy.flags and set(spy.flags) == {flags_before} and _precision_flags() == flags_before == ("none", "tf32")
    assert probed == [("cpu", dtype)]
    exact = grad.reshape(-1, OUT).double().t() @ x.reshape(-1, IN).double()
    torch.testing.assert_close(weight.main_grad.double(), 1.0 + 2.0 ** -12 + exact, rtol=1e-6, atol=1e-5)


def test_fused_weight_placeholder_grad_has_the_parameter_dtype():
    """Item 10: the dummy wgrad autograd gets for a fused weight is in the weight's dtype
    (nothing for autograd to cast), zeros when the weight is used elsewhere too."""
    from tensorpar.tensor_parallel import layers as linear

    weight = torch.nn.Parameter(torch.randn(OUT, IN))
    weight.main_grad = torch.zeros(OUT, IN)
    weight.grad_added_to_main_grad = False
    x, grad = torch.randn(S, B, IN).bfloat16(), torch.randn(S, B, OUT).bfloat16()
    placeholder = linear.compute_weight_grad(weight, x, grad, gradient_accumulation_fusion=True)
    assert placeholder.dtype == torch.float32 and placeholder.shape == weight.shape
    assert weight.grad_added_to_main_grad is True
    weight.zero_out_wgrad = True
    placeholder = linear.compute_weight_grad(weight, x, grad, gradient_accumulation_fusion=True)
    assert placeholder.dtype == torch.float32 and not placeholder.any()


def _cast_count_body():
    from torch.utils._python_dispatch import TorchDispatchMode

    tp.initialize_model_parallel(torch.distributed.get_world_size())
    layer = tp.ColumnParallelLinear(IN, OUT, bias=False)
    casts = []

    class CountWeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0] is layer.weight:
                casts.append(kwargs["dtype"])
            return func(*args, **(kwargs or {}))

    x = torch.randn(S, B, IN, requires_grad=True)
    with CountWeightCasts():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = layer(x)
        out.float().sum().backward()
    return casts


def test_weight_is_cast_once_per_micro_batch_under_autocast():
    """Item 9: forward casts the fp32 weight to bf16 and backward reuses that copy."""
    assert run_on_ranks(_cast_count_body, 2) == [[torch.bfloat16]] * 2


# ------------------------------------------------------------------- what Megatron ports use

def _functional_positional_body():
    # TP is 1, so only the group passed positionally spans both ranks: ignoring it shows.
    tp.initialize_model_parallel(1)
    group = torch.distributed.group.WORLD
    n, r = torch.distributed.get_world_size(), torch.distributed.get_rank()
    weight, bias, x, grad = _full_problem(5, torch.float32)
    ref_out, ref_dx, ref_dw, _ = _reference(weight, bias, x, grad)
    w_local, b_local, grad_local = weight.chunk(n, 0)[r], bias.chunk(n)[r], grad.chunk(n, -1)[r]
    # megatron-core 0.16.1: (input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
    # sequence_parallel, tp_group, grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce).
    x_local = x.clone().requires_grad_(True)
    out = tp.linear_with_frozen_weight(x_local, w_local, b_local, False, True, False, group, None, None, None)
    out.backward(grad_local)
    _close(out, ref_out.chunk(n, -1)[r], "frozen positional", "output")
    _close(x_local.grad, ref_dx, "frozen positional", "input grad")  # dgrad all-reduced over the group
    with pytest.raises(ValueError, match="frozen weight has no wgrad to defer"):
        tp.linear_with_frozen_weight(x_local, w_local, None, False, True, False, group, [])
    # (..., sequence_parallel, grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)
    x_local, w = x.clone().requires_grad_(True), w_local.clone().requires_grad_(True)
    with pytest.warns(DeprecationWarning, match="async_grad_allreduce is deprecated"):
        out = tp.linear_with_grad_accumulation_and_async_allreduce(x_local, w, b_local, False, True, False,
                                                                   None, 0, True, group)
    out.backward(grad_local)
    _close(out, ref_out.chunk(n, -1)[r], "async allreduce positional", "output")
    _close(x_local.grad, ref_dx, "async allreduce positional", "input grad")
    _close(w.grad, ref_dw.chunk(n, 0)[r], "async allreduce positional", "weight grad")
    # tensorpar 0.2's order (tp_group ninth) still reaches the group, with a warning.
    x_local = x.clone().requires_grad_(True)
    with pytest.warns(DeprecationWarning, match="ninth positional argument is async_grad_allreduce"):
        out = tp.linear_with_grad_accumulation_and_async_allreduce(x_local, w_local, b_local, False, True, False,
                                                                   None, 0, group)
    out.backward(grad_local)
    _close(x_local.grad, ref_dx, "0.2 positional", "input grad")
    return True


def test_functional_forms_take_megatron_0_16_positional_arguments():
    assert all(run_on_ranks(_functional_positional_body, 2))


def _megatron_constructor_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    # A ModelParallelConfig's fields, plus ones tensorpar does not read.
    config = SimpleNamespace(params_dtype=torch.float64, sequence_parallel=True, gradient_accumulation_fusion=False,
                             perform_initialization=True, use_cpu_initialization=True, hidden_dropout=0.1,
                             expert_model_parallel_size=1, defer_embedding_wgrad_compute=False)
    init = tp.init_method_normal(0.5)
    torch.manual_seed(3)
    fc1 = tp.ColumnParallelLinear(IN, OUT, config=config, init_method=init, bias=True, gather_output=False,
                                  stride=1, keep_master_weight_for_test=True, skip_bias_add=False,
                                  skip_weight_param_allocation=False, embedding_activation_buffer=None,
                                  grad_output_buffer=None, is_expert=False, tp_comm_buffer_name="fc1",
                                  disable_grad_reduce=False, tp_group=None)
    fc2 = tp.RowParallelLinear(OUT, IN, config=config, init_method=init, bias=True, input_is_parallel=True,
                               skip_bias_add=False, stride=1, keep_master_weight_for_test=True, is_expert=False,
                               tp_comm_buffer_name="fc2", tp_group=None)
    for layer, dim in ((fc1, 0), (fc2, 1)):
        assert layer.sequence_parallel and layer.weight.dtype == torch.float64, layer
        assert layer.weight.device.type == "cpu" and layer.master_weight.shape == (layer.output_size, layer.input_size)
        assert torch.equal(layer.weight, layer.master_weight.chunk(n, dim)[r]), layer
    # The pair under SP against the unsharded computation from the master weights.
    torch.manual_seed(4)
    x, grad, b1, b2 = (torch.randn(shape, dtype=torch.float64) for shape in ((S, B, IN), (S, B, IN), OUT, IN))
    with torch.no_grad():
        fc1.bias.copy_(b1.chunk(n)[r])
        fc2.bias.copy_(b2)
    full = [t.clone().requires_grad_(True) for t in (x, fc1.master_weight, b1, fc2.master_weight, b2)]
    torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(full[0], full[1], full[2])),
                               full[3], full[4]).backward(grad)
    x_local = x.chunk(n, 0)[r].clone().requires_grad_(True)
    out, _ = fc2(torch.nn.functional.gelu(fc1(x_local)[0]))
    out.backward(grad.chunk(n, 0)[r])
    tp.allreduce_sequence_parallel_grads(torch.nn.ModuleList([fc1, fc2]))
    for what, actual, expected in (("input grad", x_local.grad, full[0].grad.chunk(n, 0)[r]),
                                   ("fc1 weight grad", fc1.weight.grad, full[1].grad.chunk(n, 0)[r]),
                                   ("fc1 bias grad", fc1.bias.grad, full[2].grad.chunk(n)[r]),
                                   ("fc2 weight grad", fc2.weight.grad, full[3].grad.chunk(n, 1)[r]),
                                   ("fc2 bias grad", fc2.bias.grad, full[4].grad)):
        _close(actual, expected, "Megatron config", what)
    # runtime_gather_output (forward's third positional) overrides gather_output for one call.
    fc = tp.ColumnParallelLinear(IN, OUT, config=SimpleNamespace(params_dtype=torch.float64), init_method=init,
                                 keep_master_weight_for_test=True)
    with torch.no_grad():
        gathered, _ = fc(x, None, True)
        _close(gathered, torch.nn.functional.linear(x, fc.master_weight), "runtime_gather_output", "output")
        assert fc(x)[0].shape == (S, B, OUT // n)
    # Megatron's deferred-wgrad lists are the ones the layer fills.
    activations, grads = [], []
    fc = tp.ColumnParallelLinear(IN, OUT, embedding_activation_buffer=activations, grad_output_buffer=grads)
    assert fc.activation_buffer is activations and fc.grad_output_buffer is grads
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: params_dtype=torch.float16 contradicts "
                                         r"config.params_dtype=torch.float64"):
        tp.ColumnParallelLinear(IN, OUT, config=config, params_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"RowParallelLinear: device='meta' contradicts "
                                         r"config.use_cpu_initialization=True"):
        tp.RowParallelLinear(OUT, IN, config=config, input_is_parallel=True, device="meta")
    return True


def test_layers_take_megatron_config_and_constructor_arguments():
    assert all(run_on_ranks(_megatron_constructor_body, 2))


def _allreduce_attribute_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    marks = []
    for is_expert in (False, True):
        for layer in (tp.ColumnParallelLinear(IN, OUT, is_expert=is_expert),
                      tp.RowParallelLinear(OUT, IN, is_expert=is_expert)):
            marks.append((is_expert, layer.weight.allreduce, layer.bias.allreduce))
    return marks


def test_parameters_carry_megatron_allreduce_attribute():
    marks = run_on_ranks(_allreduce_attribute_body, 2)[0]
    assert marks == [(False, True, True)] * 2 + [(True, False, False)] * 2


def _skip_weight_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    weight, _, x, grad = _full_problem(6, torch.float32)
    head = tp.ColumnParallelLinear(IN, OUT, bias=False, skip_weight_param_allocation=True)
    assert head.weight is None and list(head.parameters()) == []
    with pytest.raises(ValueError, match="skip_weight_param_allocation=True, so forward needs the weight"):
        head(x)
    with pytest.raises(ValueError, match=r"expected \[%d, %d\]" % (OUT // n, IN)):
        head(x, weight=torch.randn(OUT, IN + 1))
    shard = weight.chunk(n, 0)[r].clone().requires_grad_(True)
    x_local = x.clone().requires_grad_(True)
    out, _ = head(x_local, weight=shard)
    out.backward(grad.chunk(n, -1)[r])
    ref_out, ref_dx, ref_dw, _ = _reference(weight, torch.zeros(OUT), x, grad, with_bias=False)
    case = "skip_weight_param_allocation"
    _close(out, ref_out.chunk(n, -1)[r], case, "output")
    _close(x_local.grad, ref_dx, case, "input grad")
    _close(shard.grad, ref_dw.chunk(n, 0)[r], case, "weight grad")
    return True


def test_skip_weight_param_allocation_allocates_no_weight():
    assert all(run_on_ranks(_skip_weight_body, 2))


# Uneven partitions: per-rank sizes (and rows several ranks hold) against the unsharded layer.
UNEVEN_SIZES = {1: [10], 2: [6, 4], 3: [4, 4, 2], 4: [4, 3, 2, 1]}


def _rows_slices(rows, r):
    return torch.cat([torch.arange(a, b) for a, b in rows[r]])


def _uneven_column_case(n, r, *, sp, gather_output, stride, sizes, rows):
    case = dict(tp=n, sp=sp, gather_output=gather_output, stride=stride, sizes=sizes, rows=rows)
    out_size = 10 * stride if rows is None else max(b for ranges in rows for _, b in ranges)
    torch.manual_seed(7)
    weight, bias = torch.randn(out_size, IN), torch.randn(out_size)
    x, grad = torch.randn(12, B, IN), torch.randn(12, B, out_size)  # 12 rows: SP at TP 1-4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = tp.ColumnParallelLinear(IN, out_size, sequence_parallel=sp, gather_output=gather_output,
                                        stride=stride, partition_sizes=sizes, partition_rows=rows)
    layout_rows = layer.partition_rows or tuple(shard_rows(out_size, n, q, stride)
                                                for q in range(n))
    mine = _rows_slices(layout_rows, r)
    with torch.no_grad():
        layer.weight.copy_(weight[mine])
        layer.bias.copy_(bias[mine])
    x_local = (x.chunk(n, 0)[r] if sp and n > 1 else x).clone().requires_grad_(True)
    out, _ = layer(x_local)
    if gather_output:
        order = torch.cat([_rows_slices(layout_rows, q) for q in range(n)])
        out.backward(grad[..., order])
    else:
        # A row several ranks hold gets a part of its output grad on each (as attention's K/V
        # rows do, one part per rank's queries); its weight grad is then the whole sum on each.
        holders = torch.zeros(out_size)
        for q in range(n):
            holders[_rows_slices(layout_rows, q)] += 1
        out.backward(grad[..., mine] / holders[mine])
    ref_out, ref_dx, ref_dw, ref_db = _reference(weight, bias, x, grad)
    _close(out, ref_out[..., order] if gather_output else ref_out[..., mine], case, "output")
    _close(x_local.grad, ref_dx.chunk(n, 0)[r] if sp and n > 1 else ref_dx, case, "input grad")
    _close(layer.weight.grad, ref_dw[mine], case, "weight grad")
    _close(layer.bias.grad, ref_db[mine], case, "bias grad")


def _uneven_row_case(n, r, *, sp, input_is_parallel, sizes):
    case = dict(tp=n, sp=sp, input_is_parallel=input_is_parallel, sizes=sizes)
    torch.manual_seed(8)
    weight, bias, x, grad = torch.randn(OUT, 10), torch.randn(OUT), torch.randn(12, B, 10), torch.randn(12, B, OUT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = tp.RowParallelLinear(10, OUT, sequence_parallel=sp, input_is_parallel=input_is_parallel,
                                     partition_sizes=sizes)
    actual = layer.partition_sizes or [10 // n] * n
    mine = slice(sum(actual[:r]), sum(actual[:r + 1]))
    with torch.no_grad():
        layer.weight.copy_(weight[:, mine])
        layer.bias.copy_(bias)
    x_local = (x[..., mine] if input_is_parallel else x).clone().requires_grad_(True)
    out, _ = layer(x_local)
    out.backward(grad.chunk(n, 0)[r] if sp and n > 1 else grad)
    tp.allreduce_sequence_parallel_grads(layer)
    ref_out, ref_dx, ref_dw, ref_db = _reference(weight, bias, x, grad)
    _close(out, ref_out.chunk(n, 0)[r] if sp and n > 1 else ref_out, case, "output")
    _close(x_local.grad, ref_dx[..., mine] if input_is_parallel else ref_dx, case, "input grad")
    _close(layer.weight.grad, ref_dw[:, mine], case, "weight grad")
    _close(layer.bias.grad, ref_db, case, "bias grad")


def _uneven_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    # Each rank its own row, and rows n..n+2 on every rank; rank 0 also holds row n+3 alone.
    shared = tuple([(q, q + 1), (n, n + 2)] + ([(n + 2, n + 3)] if q == 0 else []) for q in range(n))
    count = 0
    for sp in (False, True):
        for gather_output in (False, True) if not sp else (False,):
            for stride, sizes, rows in ((1, UNEVEN_SIZES[n], None), (1, None, None), (2, None, None),
                                        (2, [(10 + q) // n for q in range(n)], None), (1, None, shared)):
                if not (gather_output and rows):
                    _uneven_column_case(n, r, sp=sp, gather_output=gather_output, stride=stride, sizes=sizes,
                                        rows=rows)
                    count += 1
        for input_is_parallel in (True, False) if not sp else (True,):
            for sizes in (UNEVEN_SIZES[n], None):
                _uneven_row_case(n, r, sp=sp, input_is_parallel=input_is_parallel, sizes=sizes)
                count += 1
    return count


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.slow
def test_uneven_partitions_match_unsharded(world_size):
    counts = run_on_ranks(_uneven_body, world_size)
    assert counts == [counts[0]] * world_size and counts[0] == 20


def _uneven_init_body(stride, sizes_by_tp):
    """The shards of an uneven layout concatenate (by their rows) to the TP=1 weight."""
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    torch.manual_seed(11)
    layer = tp.ColumnParallelLinear(IN, 10 * stride, stride=stride, partition_sizes=sizes_by_tp[n])
    full = gather_full_tensor(layer.weight, partition_dim=0, stride=stride, partition_rows=layer.partition_rows)
    torch.manual_seed(11)
    expected = torch.empty(10 * stride, IN)
    init_weight_shard(expected, init_method_normal(0.02), partition_dim=0, stride=stride)
    return torch.equal(full, expected)


@pytest.mark.parametrize("world_size", [3, 4])
def test_uneven_initialization_is_tp_invariant(world_size):
    assert all(run_on_ranks(_uneven_init_body, world_size, 1, UNEVEN_SIZES))
    assert all(run_on_ranks(_uneven_init_body, world_size, 2, {3: [4, 3, 3], 4: [3, 3, 2, 2]}))


def test_bad_partition_sizes_are_clear_errors():
    assert all(run_on_ranks(_bad_partition_body, 2))


def _bad_partition_body():
    tp.initialize_model_parallel(2)
    for kwargs, match in ((dict(partition_sizes=[6, 3]), r"summing to output_size 10, got \[6, 3\]"),
                          (dict(partition_sizes=[10]), "2 non-negative ints"),
                          (dict(partition_rows=[[(0, 5)], [(6, 10)]]), "covering all 10 rows"),
                          (dict(partition_rows=[[(0, 6)], [(4, 10)]], gradient_accumulation_fusion=True),
                           "gradient_accumulation_fusion")):
        with pytest.raises(ValueError, match=match):
            tp.ColumnParallelLinear(IN, 10, **kwargs)
    return True
