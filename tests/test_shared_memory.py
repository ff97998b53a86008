"""The exchanges between the ranks of one host through shared memory: several in flight at once,
a group that cannot share memory, no file left behind, a peer that ended, never came or stopped."""

import datetime
import functools
import os
import signal
import time
import unittest.mock

import pytest
import torch

import tensorpar as tp
from tensorpar import comm, shared_memory
from tensorpar.tools.launch import LaunchError, launch_local
from tests.harness import run_on_ranks
from tests.op_counter import shared_memory_starts


def _in_flight_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    n, r = comm.group_size(group), comm.group_rank(group)
    per_rank = [torch.randn(2 * n, 3, generator=torch.Generator().manual_seed(j)) for j in range(n)]
    with shared_memory_starts() as starts:
        summed = comm.all_reduce(per_rank[r].clone(), group, async_op=True)
        gathered = comm.all_gather(per_rank[r], group, async_op=True)
        scattered = comm.reduce_scatter(per_rank[r].to(torch.bfloat16), group, async_op=True)
        broadcast = comm.broadcast(torch.full((2,), float(r)), torch.distributed.get_global_rank(group, 0), group)
        # Waited in another order than started: each wait finishes what was started before it.
        torch.testing.assert_close(scattered.wait(), sum(p.to(torch.bfloat16) for p in per_rank).chunk(n)[r])
        torch.testing.assert_close(gathered.wait(), torch.cat(per_rank))
        assert torch.equal(summed.wait(), functools.reduce(torch.add, per_rank))  # in rank order
    torch.testing.assert_close(broadcast, torch.zeros(2))
    assert gathered.wait() is gathered.wait()
    return len(starts)


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchanges_in_flight_together_finish_whatever_order_they_are_waited_in(world_size):
    assert run_on_ranks(_in_flight_body, world_size) == [3] * world_size


def _slot_by_slot_body():
    n = torch.distributed.get_world_size()
    r = torch.distributed.get_rank()
    with unittest.mock.patch.object(shared_memory, "SLOT_BYTES", 96):  # a part spans slots, unaligned
        group = torch.distributed.new_group(list(range(n)))
        assert shared_memory.channel(group) is not None
        for dtype in (torch.float32, torch.bfloat16):
            per_rank = [torch.randn(4 * n, 7, generator=torch.Generator().manual_seed(j)).to(dtype) for j in range(n)]
            total = functools.reduce(torch.add, per_rank)
            assert torch.equal(comm.all_gather(per_rank[r], group), torch.cat(per_rank))
            assert torch.equal(comm.reduce_scatter(per_rank[r], group), total.chunk(n)[r])
            assert torch.equal(comm.reduce_scatter(per_rank[r], group, async_op=True).wait(), total.chunk(n)[r])
            assert torch.equal(comm.all_reduce(per_rank[r].clone(), group), total)
            assert torch.equal(comm.all_gather(per_rank[r][:0], group), per_rank[r][:0])  # nothing to send
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_what_is_larger_than_a_slot_goes_through_it_a_slot_at_a_time(world_size):
    assert all(run_on_ranks(_slot_by_slot_body, world_size))


def _refused_body():
    group = torch.distributed.new_group([0, 1])  # new: no channel asked for yet
    r = comm.group_rank(group)
    paths, path = [], shared_memory._path
    with (unittest.mock.patch.dict(os.environ, {shared_memory.ENV: "0"} if r == 1 else {}),
          unittest.mock.patch.object(shared_memory, "_path", lambda token: paths.append(path(token)) or paths[-1])):
        made = shared_memory.channel(group)
        summed = comm.all_reduce(torch.full((3,), float(r + 1)), group)
    torch.testing.assert_close(summed, torch.full((3,), 3.0))
    return made is None, bool(paths) and not any(os.path.exists(p) for p in paths)


def test_a_rank_that_may_not_share_memory_keeps_its_group_on_gloo_and_no_file_is_left():
    """Rank 1 has TENSORPAR_SHARED_MEMORY=0: neither rank uses the segment rank 0 made, which is gone."""
    results = run_on_ranks(_refused_body, 2)
    assert results == [(True, True)] * 2


def _mapped_body():
    group = torch.distributed.new_group([0, 1])
    paths, path = [], shared_memory._path
    with unittest.mock.patch.object(shared_memory, "_path", lambda token: paths.append(path(token)) or paths[-1]):
        made = shared_memory.channel(group)
    return made is not None, bool(paths) and not any(os.path.exists(p) for p in paths)


def test_the_segment_is_mapped_by_every_rank_and_its_file_removed():
    assert run_on_ranks(_mapped_body, 2) == [(True, True)] * 2


def _failed_while_made_body():
    group = torch.distributed.new_group([0, 1])
    paths, path = [], shared_memory._path

    def failing(*args, **kwargs):
        raise RuntimeError("a peer went away")

    with (unittest.mock.patch.object(shared_memory, "_path", lambda token: paths.append(path(token)) or paths[-1]),
          unittest.mock.patch.object(shared_memory.dist, "all_reduce", failing), pytest.raises(RuntimeError)):
        shared_memory.channel(group)  # its agreement fails on every rank, after rank 0 made the file
    torch.distributed.barrier(group)  # both ranks are past their failure
    return bool(paths) and not any(os.path.exists(p) for p in paths)


def test_a_segment_whose_making_fails_leaves_no_file():
    assert run_on_ranks(_failed_while_made_body, 2) == [True, True]


_TIMEOUTS = {"ended": datetime.timedelta(minutes=30), "late": datetime.timedelta(0),
             "stopped": datetime.timedelta(seconds=2)}


def _peer_gone_body(how: str):
    tp.initialize_model_parallel(2)
    group = tp.get_tensor_model_parallel_group()
    with unittest.mock.patch.object(shared_memory, "_timeout", lambda group: _TIMEOUTS[how]):
        comm.all_reduce(torch.ones(3), group)  # the channel is made, and works
    if comm.group_rank(group) == 1:
        if how == "ended":
            os._exit(0)  # without a word to the launcher, which would end rank 0 on a failure
        if how == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(3)
    comm.all_reduce(torch.ones(3), group)


@pytest.mark.parametrize("how, message", [
    ("ended", r"group rank 1 \(process \d+\) has ended"),
    ("late", r"timed out after the group's timeout \(0 s\) waiting for group rank 1"),
    ("stopped", r"^rank 1 \(pid \d+\) stopped responding: its process was stopped \(SIGSTOP\)")],
    ids=["ended", "late", "stopped"])
def test_a_wait_for_a_peer_that_ended_never_came_or_stopped_fails_within_seconds(how, message):
    began = time.monotonic()
    with pytest.raises(LaunchError, match=message):
        launch_local(_peer_gone_body, how, nproc=2)
    assert time.monotonic() - began < 30
