"""All-gather and reduce-scatter as rings of point-to-point exchanges or through shared memory, and
FSDP using them under gloo."""

import functools
import unittest.mock

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar import fsdp, shared_memory
from tensorpar.p2p_collectives import (flat_all_gather, flat_reduce_scatter, ring_all_gather, ring_reduce_scatter,
                                       uses_ring)
from tests.harness import run_on_ranks
from tests.op_counter import shared_memory_starts


def _gathered_and_reduced(all_gather, reduce_scatter, group, dtype):
    """``all_gather`` of every rank's 6 elements (checked: in rank order) and ``reduce_scatter``
    of its ``6 n``: each writes into and returns the output it is given. Returns the reduced
    chunk, every rank's chunk ``rank`` that went into it, and this rank's flat input."""
    n, r = dist.get_world_size(), dist.get_rank()
    inputs = [torch.randn(6, generator=torch.Generator().manual_seed(k)).to(dtype) for k in range(n)]
    gathered = torch.empty(6 * n, dtype=dtype)
    assert all_gather(gathered, inputs[r], group) is gathered
    assert torch.equal(gathered, torch.cat(inputs))
    flats = [torch.randn(6 * n, generator=torch.Generator().manual_seed(10 + k)).to(dtype) for k in range(n)]
    reduced = torch.empty(6, dtype=dtype)
    assert reduce_scatter(reduced, flats[r].clone(), group) is reduced
    return reduced, [flat.view(n, 6)[r] for flat in flats], flats[r]


def _ring_body():
    n, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16):
        reduced, chunks, flat = _gathered_and_reduced(ring_all_gather, ring_reduce_scatter, group, dtype)
        # Chunk c summed round the ring from rank c + 1 to rank c, in the tensors' dtype.
        expected = chunks[(r + 1) % n].clone()
        for k in range(2, n + 1):
            expected += chunks[(r + k) % n]
        assert torch.equal(reduced, expected)
        if dtype == torch.float32 and n == 2:  # one addition per element: gloo's bits too
            by_gloo = torch.empty(6)
            dist.reduce_scatter_tensor(by_gloo, flat.clone(), group=group)
            assert torch.equal(reduced, by_gloo)
    assert uses_ring(group) == (n > 1)
    with pytest.raises(ValueError, match=rf"ring_all_gather: output \[7\] must be 1-D, contiguous and {n} times "
                                         r"the input \[6\]"):
        ring_all_gather(torch.empty(7), torch.empty(6), group)
    with pytest.raises(ValueError, match=rf"ring_reduce_scatter: input \[7\] and output \[6\] must be 1-D and "
                                         rf"contiguous, the input {n} times the output"):
        ring_reduce_scatter(torch.empty(6), torch.empty(7), group)
    with pytest.raises(ValueError, match=rf"ring_reduce_scatter: input \[{6 * n}\] and output \[6\] must be"):
        ring_reduce_scatter(torch.empty(12)[::2], torch.empty(6 * n), group)  # a strided output
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_all_gather_orders_and_ring_reduce_scatter_sums_every_ranks_chunks(world_size):
    assert run_on_ranks(_ring_body, world_size) == [True] * world_size


def _flat_body():
    group = dist.new_group(list(range(dist.get_world_size())))  # its shared memory made here
    with shared_memory_starts() as starts:
        for dtype in (torch.float32, torch.bfloat16):
            reduced, chunks, _ = _gathered_and_reduced(flat_all_gather, flat_reduce_scatter, group, dtype)
            assert torch.equal(reduced, functools.reduce(torch.add, chunks))  # in rank order
    return len(starts)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fsdps_collectives_go_through_shared_memory_summed_in_rank_order(world_size):
    assert run_on_ranks(_flat_body, world_size) == [4] * world_size


def _fsdp_on_gloo_body(shared: bool):
    rings = unittest.mock.patch.object(shared_memory, "channel", lambda group: None)
    if not shared:
        rings.start()
    tp.initialize_model_parallel(1)
    calls, reduced = [], []

    def counted(*args):
        calls.append(args[0].numel())
        return flat_all_gather(*args)

    def counted_reduce_scatter(*args):
        reduced.append(args[1].numel())
        return flat_reduce_scatter(*args)

    fsdp.flat_all_gather, fsdp.flat_reduce_scatter = counted, counted_reduce_scatter
    try:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        sharded = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        sharded.load_state_dict(plain.state_dict())
        tp.fully_shard(sharded, units=[sharded[0]])
        x = torch.randn(4 * dist.get_world_size(), 8, generator=torch.Generator().manual_seed(1))
        sharded(x.chunk(dist.get_world_size())[dist.get_rank()]).square().mean().backward()
        plain(x).square().mean().backward()
    finally:
        fsdp.flat_all_gather, fsdp.flat_reduce_scatter = flat_all_gather, flat_reduce_scatter
        if not shared:
            rings.stop()
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(fsdp.gather_dp_shards(p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # The root, then the unit gathered for forward; the unit again for backward (the root stays gathered).
    assert calls == [16 * 4 + 4, 8 * 16 + 16, 8 * 16 + 16], calls
    # Gradients (averaged over DP: the grads above are the global batch's mean) reduced by the
    # root, whose last layer's backward runs first, then by the unit.
    assert reduced == [16 * 4 + 4, 8 * 16 + 16], reduced
    return True


@pytest.mark.parametrize("shared", [True, False], ids=["shared memory", "rings"])
def test_fsdp_under_gloo_gathers_and_reduces_through_the_flat_collectives(shared):
    assert run_on_ranks(_fsdp_on_gloo_body, 2, shared) == [True] * 2
