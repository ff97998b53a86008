"""DP gradient reduction in buckets during backward, and the TP-aware gradient norm."""

import torch

import tensorpar as tp
from tensorpar.grads import DataParallelGradReducer, clip_grad_norm_, get_grad_norm
from tests.harness import run_on_ranks


def _dp_reducer_body(fusion: bool):
    tp.initialize_model_parallel(1)
    dp_rank, dp_size = tp.get_data_parallel_rank(), tp.get_data_parallel_world_size()

    def make_layers(fused):
        torch.manual_seed(0)
        return torch.nn.ModuleList([tp.ColumnParallelLinear(8, 8, gradient_accumulation_fusion=fused)
                                    for _ in range(3)])

    layers, plain = make_layers(fusion), make_layers(False)
    params = list(layers.parameters())
    # 8x8 fp32 weight + bias = 288 bytes: one bucket per layer.
    reducer = DataParallelGradReducer(params, dp_group=tp.get_data_parallel_group(), bucket_bytes=288)
    inputs = [[torch.randn(4, 2, 8) for _ in range(2)] for _ in range(dp_size)]

    def loss_of(x, layers=layers):
        for layer in layers:
            x = torch.tanh(layer(x)[0])
        return x.square().mean()

    reducer.zero_grad()
    with tp.CommLedger() as ledger:
        for k, x in enumerate(inputs[dp_rank]):
            reducer.sync = k == 1
            with ledger.phase(f"backward{k}"):
                loss_of(x).backward()
        reducer.finish()
    # Reference: the plain gradient of the mean over every rank's micro-batches.
    reference = [torch.zeros_like(p) for p in params]
    for rank_inputs in inputs:
        for x in rank_inputs:
            grads = torch.autograd.grad(loss_of(x, plain), list(plain.parameters()))
            for ref, g in zip(reference, grads):
                ref += g / dp_size
    for p, ref in zip(params, reference):
        assert p.grad is p.main_grad
        torch.testing.assert_close(p.main_grad, ref, rtol=1e-6, atol=1e-7)
    if dp_size > 1:
        assert ledger.count("all_reduce", phase="backward0") == 0
        # Every bucket is launched inside the last backward, asynchronously.
        assert ledger.count("all_reduce", phase="backward1") == len(reducer.buckets) == 3
        assert all(r.async_op for r in ledger.filter(op="all_reduce"))
    reducer.remove_hooks()
    return True


def test_bucketed_dp_reduction_matches_the_global_batch_gradient():
    assert run_on_ranks(_dp_reducer_body, 2, False) == [True, True]


def test_dp_reduction_with_gradient_accumulation_fusion():
    assert run_on_ranks(_dp_reducer_body, 2, True) == [True, True]


def _grad_norm_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    full_grad, replicated_grad = torch.randn(4 * n, 3), torch.randn(5)
    sharded = torch.nn.Parameter(torch.zeros(4, 3))
    tp.initialization.set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=0)
    replicated = torch.nn.Parameter(torch.zeros(5))
    sharded.grad = full_grad.chunk(n, 0)[r].clone()
    replicated.grad = replicated_grad.clone()
    expected = torch.cat([full_grad.reshape(-1), replicated_grad]).norm()
    torch.testing.assert_close(get_grad_norm([sharded, replicated]), expected)
    norm = clip_grad_norm_([sharded, replicated], 0.5)
    torch.testing.assert_close(norm, expected)
    torch.testing.assert_close(get_grad_norm([sharded, replicated]), torch.tensor(0.5), rtol=1e-5, atol=0)
    return True


def test_grad_norm_counts_each_parameter_once():
    assert run_on_ranks(_grad_norm_body, 2) == [True, True]
    assert run_on_ranks(_grad_norm_body, 1) == [True]
