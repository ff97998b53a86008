"""Collectives along any dimension, async handles, and what CommLedger records."""

import contextlib
import functools
import time
import unittest.mock

import pytest
import torch

import tensorpar as tp
from tensorpar import comm, gloo_transport, shared_memory
from tests.harness import run_on_ranks


@contextlib.contextmanager
def _counting_exchanges():
    """Lists the calls of gloo's ``all_to_all_single`` (the tensor sent's shape, its input split
    sizes) and of shared-memory channels' ``start`` (the shape, "shared memory") into the list it
    yields."""
    calls, all_to_all, start = [], torch.distributed.all_to_all_single, shared_memory.Channel.start

    def counting_all_to_all(*args, **kwargs):
        calls.append((args[1].shape, kwargs.get("input_split_sizes")))
        return all_to_all(*args, **kwargs)

    def counting_start(channel, send, *args, **kwargs):
        calls.append((send.shape, "shared memory"))
        return start(channel, send, *args, **kwargs)

    with (unittest.mock.patch.object(torch.distributed, "all_to_all_single", counting_all_to_all),
          unittest.mock.patch.object(shared_memory.Channel, "start", counting_start)):
        yield calls


def _without_shared_memory():
    return unittest.mock.patch.object(shared_memory, "channel", lambda group: None)


def _never(*args, **kwargs) -> bool:
    return False


@contextlib.contextmanager
def _gloo_own():
    with (unittest.mock.patch.object(comm, "_exchanged", _never),
          unittest.mock.patch.object(comm, "_through_shared_memory", _never)):
        yield


_TRANSPORTS = {"shared memory": contextlib.nullcontext, "gloo's all-to-all": _without_shared_memory,
               "gloo's own": _gloo_own}


def _collectives_body(transport: str):
    with _counting_exchanges() as calls, _TRANSPORTS[transport]():
        _collectives()
    # On gloo each collective of these small CPU tensors is one exchange (comm._exchanged), over
    # more than 2 ranks the 4 all-reduces only through shared memory; then comes the body's own
    # all-to-all.
    n = torch.distributed.get_world_size()
    exchanged = {"shared memory": 21, "gloo's all-to-all": 21 if n == 2 else 17, "gloo's own": 0}[transport]
    assert len(calls) == (0 if n == 1 else exchanged + 1), calls
    through_memory = [splits == "shared memory" for _, splits in calls[:-1]]
    assert all(through_memory) if transport == "shared memory" else not any(through_memory), calls
    if n == 2 and transport == "gloo's all-to-all":  # each sends the peer its block, none to itself
        rank = torch.distributed.get_rank()
        assert all(splits[rank] == 0 and splits[1 - rank] > 0 for _, splits in calls[:-1]), calls
    return True


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


@pytest.mark.parametrize("transport", list(_TRANSPORTS))
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collectives_along_any_dim_sync_and_async(world_size, transport):
    assert all(run_on_ranks(_collectives_body, world_size, transport))


def _exchange_order_body(transport: str):
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    n, r = comm.group_size(group), comm.group_rank(group)
    with _counting_exchanges() as calls, _TRANSPORTS[transport]():
        for dtype in (torch.float32, torch.bfloat16):
            per_rank = [torch.randn(4 * n, 3, generator=torch.Generator().manual_seed(j)).to(dtype) for j in range(n)]
            in_rank_order = functools.reduce(torch.add, per_rank)   # ((x0 + x1) + x2) + x3
            assert torch.equal(comm.reduce_scatter(per_rank[r], group), in_rank_order.chunk(n)[r])
            summed = comm.all_reduce(per_rank[r].clone(), group)
            if n == 2 or transport == "shared memory":
                assert torch.equal(summed, in_rank_order)
            else:  # gloo's own, in its ring's order: n roundings of sums under 8, an ulp at 8 each
                torch.testing.assert_close(summed.float(), sum(p.float() for p in per_rank),
                                           rtol=0, atol=n * torch.finfo(dtype).eps * 8)
            assert torch.equal(comm.all_reduce(per_rank[r].clone(), group, op="min"), torch.stack(per_rank).amin(0))
        counts = [len(calls)]
        # Where the all-to-all's n copies (over 2 ranks, a swap's one) would pass EXCHANGE_MAX_BYTES
        # an all-gather or all-reduce is gloo's own, unless the group shares memory and the copies
        # are within SHARED_MEMORY_MAX_BYTES (4 MiB here); a reduce-scatter is exchanged at any size
        # (its all-to-all sends no copies).
        with unittest.mock.patch.object(gloo_transport, "SHARED_MEMORY_MAX_BYTES", 4 << 20):
            for nbytes in (comm.EXCHANGE_MAX_BYTES // (1 if n == 2 else n), 2 << 20, 4 << 20):
                big = torch.full((nbytes // 4 + n,), float(r + 1))
                summed = torch.full_like(big, n * (n + 1) / 2)
                torch.testing.assert_close(comm.all_reduce(big.clone(), group), summed)
                every = torch.cat([torch.full_like(big, j + 1) for j in range(n)])
                torch.testing.assert_close(comm.all_gather(big, group), every)
                torch.testing.assert_close(comm.reduce_scatter(big.repeat(n), group), summed)
                counts.append(len(calls) - sum(counts))
    return counts


@pytest.mark.parametrize("transport", ["shared memory", "gloo's all-to-all"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_exchanged_collectives_combine_in_rank_order_and_stop_at_their_size_limit(world_size, transport):
    """On gloo, CPU collectives go as one exchange and combine every rank's block in rank
    order: every rank the same bits, those of ``((x0 + x1) + x2) + x3``. All-reduces over more
    than 2 ranks only through shared memory (as gloo's all-to-all they would send more than the
    ring's bytes)."""
    shared = transport == "shared memory"
    small = {1: 0, 2: 6, 4: 6 if shared else 2}[world_size]
    past_the_all_to_all = {1: 0, 2: 3, 4: 3}[world_size] if shared else min(world_size - 1, 1)
    two_mib = 3 if shared and world_size == 2 else min(world_size - 1, 1)  # over 4 ranks, 8 MiB arrive
    expected = [small, past_the_all_to_all, two_mib, min(world_size - 1, 1)]
    assert run_on_ranks(_exchange_order_body, world_size, transport) == [expected] * world_size


def _polled_collectives(group, n, r):
    x = torch.full((n, 3), float(r + 1))
    total = n * (n + 1) / 2
    torch.testing.assert_close(comm.all_reduce(x.clone(), group), torch.full_like(x, total))
    torch.testing.assert_close(comm.all_reduce(x.clone(), group, async_op=True).wait(), torch.full_like(x, total))
    every = torch.cat([torch.full((n, 3), float(j + 1)) for j in range(n)])
    torch.testing.assert_close(comm.all_gather(x, group), every)
    torch.testing.assert_close(comm.all_gather(x, group, async_op=True).wait(), every)
    torch.testing.assert_close(comm.all_to_all(x, group), torch.arange(1.0, n + 1).repeat_interleave(3).view(n, 3))
    torch.testing.assert_close(comm.broadcast(x.clone(), 0, group), torch.ones_like(x))


def _polling_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    n, r = comm.group_size(group), comm.group_rank(group)
    yields = []
    with (unittest.mock.patch.object(gloo_transport, "_yield_core", lambda: yields.append(1)),
          unittest.mock.patch.object(gloo_transport, "POLL_SECONDS", 10.0), _without_shared_memory()):
        began = time.perf_counter()
        _polled_collectives(group, n, r)  # exchanged, but the all-reduces over 4 ranks
        with _gloo_own():
            _polled_collectives(group, n, r)  # gloo's own
        torch.testing.assert_close(comm.reduce_scatter(torch.ones(n, 3), group), torch.full((1, 3), float(n)))
        # Each wait ended when its work reported completion, not after POLL_SECONDS.
        assert time.perf_counter() - began < 5, time.perf_counter() - began
        yields.clear()
        if r != 0:
            time.sleep(0.2)  # rank 0 waits meanwhile
        torch.testing.assert_close(comm.all_reduce(torch.ones(3), group), torch.full((3,), float(n)))
    return bool(yields)


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_on_gloo_are_waited_by_polling_with_the_core_yielded(world_size):
    """A rank waiting for its peers yields its core rather than sleeping in gloo's wait
    (gloo_transport.YieldingWait: a sleeping virtual CPU took milliseconds to wake); every work polled
    reports its completion without being waited (or the polling would run out its time)."""
    assert run_on_ranks(_polling_body, world_size)[0]


def test_an_exchange_wait_raises_what_its_collective_raised():
    class Failed:
        def is_completed(self):
            return True

        def wait(self):
            raise RuntimeError("peer 1 closed the connection")

    with pytest.raises(RuntimeError, match="peer 1 closed"):
        gloo_transport.YieldingWait(Failed()).wait()


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

    # A new group: its first exchange, inside, makes its shared memory.
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
