"""Process groups: layout, getters, errors, and collectives that time out instead of hanging."""

import time

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
