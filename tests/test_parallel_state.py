"""Process groups: layout, getters, errors, and collectives that time out instead of hanging."""

import contextlib
import os
import time
import unittest.mock
import warnings

import pytest
import torch

import tensorpar as tp
from tests.harness import run_in_fresh_world, run_on_ranks


def _groups_body():
    tp.initialize_model_parallel(2)
    rank = torch.distributed.get_rank()
    return (tp.get_tensor_model_parallel_rank(), tp.get_tensor_model_parallel_world_size(),
            tp.get_data_parallel_rank(), tp.get_data_parallel_world_size(),
            tp.get_tensor_model_parallel_src_rank(), rank)


def test_tp_groups_are_consecutive_ranks_and_dp_is_the_rest():
    assert run_on_ranks(_groups_body, 4) == [(0, 2, 0, 2, 0, 0), (1, 2, 0, 2, 0, 1),
                                             (0, 2, 1, 2, 2, 2), (1, 2, 1, 2, 2, 3)]


def _world_not_divisible_body():
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by tensor_model_parallel_size 4"):
        tp.initialize_model_parallel(4)
    return True


def test_world_size_not_divisible_by_tp():
    assert all(run_on_ranks(_world_not_divisible_body, 2))


def test_getter_before_initialize_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel"):
        tp.get_tensor_model_parallel_group()
    assert not tp.model_parallel_is_initialized()


def test_tp_group_getter_takes_megatrons_check_initialized():
    assert tp.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel"):
        tp.get_tensor_model_parallel_group(check_initialized=True)


def _reinitialize_body():
    tp.initialize_model_parallel(2)
    with pytest.raises(RuntimeError, match="already initialized"):
        tp.initialize_model_parallel(2)
    tp.destroy_model_parallel()
    assert not tp.model_parallel_is_initialized()
    tp.initialize_model_parallel(1)
    return tp.get_tensor_model_parallel_world_size(), tp.get_data_parallel_world_size()


def test_destroy_then_reinitialize_with_another_tp_size():
    assert run_on_ranks(_reinitialize_body, 2) == [(1, 2), (1, 2)]


def _crashed_peer_body():
    tp.initialize_model_parallel(2, timeout=3)
    layer = tp.RowParallelLinear(8, 8, input_is_parallel=True)
    if torch.distributed.get_rank() == 1:
        return "skipped the collective"
    start = time.monotonic()
    try:
        layer(torch.randn(2, 1, 4))
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError
        return f"raised after {time.monotonic() - start:.1f}s: {type(exc).__name__}"
    return "returned"


def test_collective_a_peer_never_joins_raises_within_timeout():
    result = run_in_fresh_world(_crashed_peer_body, 2, timeout=60)
    assert result[1] == "skipped the collective"
    assert result[0].startswith("raised after"), result[0]
    assert float(result[0].split()[2][:-2]) < 20, result[0]


def _fake_cuda(devices: int, current: int = 0):
    """torch.cuda as a machine with ``devices`` GPUs would answer (the suite has none)."""
    calls = []
    patches = [unittest.mock.patch.object(torch.cuda, "device_count", lambda: devices),
               unittest.mock.patch.object(torch.cuda, "current_device", lambda: current),
               unittest.mock.patch.object(torch.cuda, "set_device", calls.append)]
    return patches, calls


def _select(devices, rank, *, local_rank=None, current=0):
    patches, calls = _fake_cuda(devices, current)
    env = {} if local_rank is None else {"LOCAL_RANK": str(local_rank)}
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(unittest.mock.patch.dict(os.environ, env))
        if local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        device = tp.parallel_state.select_cuda_device(rank)
    return device, calls


def test_nccl_device_comes_from_local_rank_else_rank_modulo_devices():
    """Item 5: the rank's GPU, never everyone on cuda:0."""
    assert _select(8, 13, local_rank=5) == (torch.device("cuda", 5), [5])
    assert _select(4, 6) == (torch.device("cuda", 2), [2])
    assert _select(4, 6, local_rank=2, current=2) == (torch.device("cuda", 2), [2])
    with pytest.raises(RuntimeError, match=r"torch.cuda.set_device chose cuda:3 but LOCAL_RANK=1 selects cuda:1"):
        _select(4, 1, local_rank=1, current=3)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=4 selects cuda:4, but only 2 CUDA devices are visible"):
        _select(2, 4, local_rank=4)


def test_a_process_that_sees_one_gpu_uses_it_whatever_its_local_rank():
    """Issue 16 item 5: ``srun --gpus-per-task=1`` gives each task its own CUDA_VISIBLE_DEVICES."""
    for local_rank in (None, 0, 3):
        assert _select(1, 7, local_rank=local_rank) == (torch.device("cuda", 0), [0])


def _user_created_nccl_group_body(max_connections):
    # The process group exists already (the user called init_process_group, as after torchrun);
    # it claims to be NCCL while torch.cuda answers as a machine with 2 GPUs.
    patches, calls = _fake_cuda(2)
    env = {} if max_connections is None else {"CUDA_DEVICE_MAX_CONNECTIONS": max_connections}
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(unittest.mock.patch.dict(os.environ, env))
        if max_connections is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        stack.enter_context(unittest.mock.patch.object(tp.parallel_state.dist, "get_backend", lambda *a: "nccl"))
        tp.initialize_model_parallel(2)
        device = tp.parallel_state.default_device()
    warned = any("CUDA_DEVICE_MAX_CONNECTIONS" in str(w.message) for w in caught)
    return calls, device, warned


def test_initialize_selects_the_gpu_for_a_user_created_nccl_group_and_warns_about_connections():
    """Items 5 and 6."""
    results = run_on_ranks(_user_created_nccl_group_body, 2, None)
    assert results == [([r], torch.device("cuda", r), True) for r in range(2)]
    results = run_on_ranks(_user_created_nccl_group_body, 2, "1")
    assert [warned for _, _, warned in results] == [False, False]
