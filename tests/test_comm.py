"""Collectives along any dimension, async handles, and what CommLedger records."""

import collections
import contextlib
import unittest.mock

import pytest
import torch

import tensorpar as tp
from tensorpar.distributed import comm
from tests.harness import run_on_ranks


_TORCH_COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "broadcast")


@contextlib.contextmanager
def _counting_torch_collectives():
    """Counts the calls of ``torch.distributed``'s own collectives into the Counter it yields."""
    counts = collections.Counter()

    def counting(name, own):
        def call(*args, **kwargs):
            counts[name] += 1
            return own(*args, **kwargs)
        return call

    with contextlib.ExitStack() as stack:
        for name in _TORCH_COLLECTIVES:
            stack.enter_context(unittest.mock.patch.object(torch.distributed, name,
                                                           counting(name, getattr(torch.distributed, name))))
        yield counts


def _collectives_body():
    with _counting_torch_collectives() as counts:
        _collectives()
    return dict(counts)


def _collectives():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    n, r = comm.group_size(group), comm.group_rank(group)
    torch.manual_seed(0)
    per_rank = [torch.randn(2 * n, 2 * n, 4 * n) for _ in range(n)]
    mine, total = per_rank[r], sum(per_rank)
    for dim in (0, 1, 2, -1):
        torch.testing.assert_close(comm.all_gather(per_rank[0].chunk(n, dim)[r], group, dim=dim), per_rank[0])
        handle = comm.all_gather(per_rank[0].chunk(n, dim)[r], group, dim=dim, async_op=True)
        torch.testing.assert_close(handle.wait(), per_rank[0])
    for dim in (0, 1, 2, -1):
        torch.testing.assert_close(comm.reduce_scatter(mine, group, dim=dim), total.chunk(n, dim)[r])
        handle = comm.reduce_scatter(mine, group, dim=dim, async_op=True)
        torch.testing.assert_close(handle.wait(), total.chunk(n, dim)[r])
    into = torch.empty(3, *mine.shape[1:])
    assert comm.reduce_scatter(mine, group, out=into[1:3]).data_ptr() == into[1].data_ptr()
    torch.testing.assert_close(into[1:3], total.chunk(n, 0)[r])
    torch.testing.assert_close(comm.all_reduce(mine.clone(), group), total)
    torch.testing.assert_close(comm.all_reduce(mine.clone(), group, async_op=True).wait(), total)
    strided = mine.clone().transpose(0, 2)  # summed in place, into the caller's strided view
    assert comm.all_reduce(strided, group, async_op=True).wait() is strided
    torch.testing.assert_close(strided, total.transpose(0, 2))
    torch.testing.assert_close(comm.all_reduce(mine.clone(), group, op="max"),
                               torch.stack(per_rank).amax(0))
    sent = torch.cat([torch.full((1, 2), float(10 * r + j)) for j in range(n)])
    received = comm.all_to_all(sent, group)
    torch.testing.assert_close(received, torch.cat([torch.full((1, 2), float(10 * j + r)) for j in range(n)]))
    source = torch.full((2,), float(r))
    comm.broadcast(source, tp.get_tensor_model_parallel_src_rank(), group)
    torch.testing.assert_close(source, torch.zeros(2))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collectives_along_any_dim_sync_and_async_are_torchs_own(world_size):
    """Every collective goes through ``torch.distributed``'s own function, once: the path NCCL
    users run (a group of one rank issues none)."""
    expected = {} if world_size == 1 else {"all_reduce": 4, "all_gather_single": 8, "reduce_scatter_single": 9,
                                           "all_to_all_single": 1, "broadcast": 1}
    assert run_on_ranks(_collectives_body, world_size) == [expected] * world_size


def _same_bits_body():
    group = torch.distributed.group.WORLD
    r = comm.group_rank(group)
    mine = torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 1e3
    summed = comm.all_reduce(mine, group)
    return summed.tolist()


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_all_reduce_gives_every_rank_the_same_bits(world_size):
    results = run_on_ranks(_same_bits_body, world_size)
    assert all(result == results[0] for result in results)


def _ledger_body():
    tp.initialize_model_parallel(2)
    group = tp.get_tensor_model_parallel_group()
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    with tp.CommLedger() as outer:
        comm.all_reduce(x.clone(), group)
        with tp.CommLedger() as inner, inner.phase("backward"):
            comm.reduce_scatter(x, group, dim=1, async_op=True).wait()
        comm.all_gather(x, group, dim=1)
    return outer.records, inner.records


def test_ledger_records_op_shape_bytes_group_and_phase_and_nests():
    outer, inner = run_on_ranks(_ledger_body, 2)[0]
    assert [(r.op, r.shape, r.bytes, r.group_size, r.async_op, r.phase) for r in outer] == [
        ("all_reduce", (4, 6), 48, 2, False, None),
        ("reduce_scatter", (4, 6), 48, 2, True, None),
        ("all_gather", (4, 12), 96, 2, False, None)]
    assert [(r.op, r.phase) for r in inner] == [("reduce_scatter", "backward")]
    assert outer[0].bytes_sent_per_rank == 48 and outer[2].bytes_sent_per_rank == 48
    assert all(r.dtype == torch.bfloat16 for r in outer)


def test_ledger_summary_and_queries_without_distributed():
    ledger = tp.CommLedger()
    ledger.records.append(comm.CommRecord("all_reduce", torch.float32, (2, 2), 16, 4, True, "forward"))
    assert ledger.count("all_reduce", phase="forward") == 1 and ledger.total_bytes() == 16
    assert ledger.records[0].bytes_sent_per_rank == 16 * 2 * 3 / 4
    assert "all_reduce" in ledger.summary() and ledger.ops() == ["all_reduce"]


def _strict_device_body():
    """comm.scalars places a tensor where the backend's collectives need it; the strict group of
    the CPU suite refuses one made without a device, as NCCL refuses a CPU tensor."""
    from tests.strict_device import strict_collective_device

    group = torch.distributed.new_group(list(range(torch.distributed.get_world_size())))
    assert comm.collective_device(group) == torch.device("cpu")  # gloo
    with strict_collective_device(group):
        total = comm.all_reduce(comm.scalars([1.0, 2.0], group, dtype=torch.float64), group)
        with pytest.raises(RuntimeError, match="a tensor on meta, but this backend's collectives need cpu"):
            comm.all_reduce(torch.zeros(()), group)
    torch.testing.assert_close(total, torch.tensor([2.0, 4.0], dtype=torch.float64))
    return True


def test_collectives_refuse_a_tensor_off_the_backends_device():
    assert run_on_ranks(_strict_device_body, 2) == [True, True]


def _send_recv_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    n, r = comm.group_size(group), comm.group_rank(group)
    with tp.CommLedger() as ledger:
        got = comm.send_recv(torch.full((3,), float(r)), torch.empty(3), group, send_to=(r + 1) % n,
                             recv_from=(r - 1) % n, async_op=True).wait()
    torch.testing.assert_close(got, torch.full((3,), float((r - 1) % n)))
    return [(x.op, x.bytes, x.group_size, x.async_op, x.bytes_sent_per_rank) for x in ledger.records]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_send_recv_passes_a_tensor_one_step_around_the_ring(world_size):
    expected = [] if world_size == 1 else [("send_recv", 12, world_size, True, 12.0)]
    assert run_on_ranks(_send_recv_body, world_size) == [expected] * world_size
