"""The chunked pipelines against the plain collective-then-GEMM (or GEMM-then-collective)."""

import pytest
import torch

import tensorpar as tp
from tensorpar import comm
from tensorpar.overlap import all_gather_matmul, chunk_sizes, matmul_reduce
from tests.harness import run_on_ranks


def test_chunk_sizes_are_even_larger_first_and_capped_at_the_rows():
    assert chunk_sizes(8, 3) == [3, 3, 2]
    assert chunk_sizes(2, 4) == [1, 1]
    assert chunk_sizes(5, 1) == [5]
    assert chunk_sizes(0, 2) == [0]


def _pipelines_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    n, r = comm.group_size(group), comm.group_rank(group)
    torch.manual_seed(0)
    full, rhs, bias = torch.randn(6 * n, 3, 5), torch.randn(5, 7), torch.randn(7)
    partials = [torch.randn(6 * n, 3, 5) for _ in range(n)]
    for chunks in (1, 2, 4, 100):
        out, gathered = all_gather_matmul(full.chunk(n)[r], rhs, group, chunks=chunks, bias=bias,
                                          keep_gathered=True)
        assert torch.equal(out, torch.nn.functional.linear(full, rhs.t(), bias)), chunks
        # Chunk i of every rank's slice, in rank order.
        by_rank = full.view(n, 6, 3, 5)
        assert torch.equal(torch.cat([g.transpose(0, 1) for g in gathered]).transpose(0, 1), by_rank), chunks
        for scatter in (False, True):
            expected = comm.all_reduce(partials[r] @ rhs, group)
            if scatter:
                expected = expected.chunk(n)[r]
            got = matmul_reduce(partials[r], rhs, group, chunks=chunks, scatter=scatter, async_op=True).wait()
            torch.testing.assert_close(got, expected, msg=lambda m: f"chunks={chunks} scatter={scatter}: {m}")
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_pipelines_equal_the_unchunked_computation(world_size):
    assert all(run_on_ranks(_pipelines_body, world_size))



def _interleave_body():
    """Two row-layer stages interleaved over batch halves equal the plain sequence of them."""
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    for sp in (False, True) if n > 1 else (False,):
        tp.model_parallel_manual_seed(0)
        layers = [tp.RowParallelLinear(8 * n, 4, input_is_parallel=True, sequence_parallel=sp) for _ in range(2)]
        lift = torch.randn(4, 8)  # a stage's own compute: widen the residual to the row input
        x = torch.randn(2 if sp else 2 * n, 4, 4, requires_grad=True)

        def widen(h):
            return (tp.gather_from_sequence_parallel_region(h) if sp else h) @ lift

        def run(forward):
            x.grad = None
            for layer in layers:
                layer.weight.grad = layer.bias.grad = None
            out = forward()
            out.backward(torch.ones_like(out))
            return [out.detach(), x.grad, *(p.grad for layer in layers for p in layer.parameters())]

        def plain():
            h = x
            for layer in layers:
                h = h + layer(widen(h))[0]
            return h

        stages = [(lambda h, layer=layer: layer.start(widen(h)), lambda h, reduced: h + reduced[0])
                  for layer in layers]
        for got, expected in zip(run(lambda: tp.interleave(x, stages, parts=2)), run(plain)):
            torch.testing.assert_close(got, expected, msg=lambda m: f"sp={sp}: {m}")
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_interleaved_halves_equal_the_plain_block(world_size):
    assert all(run_on_ranks(_interleave_body, world_size))
