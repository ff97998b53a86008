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
