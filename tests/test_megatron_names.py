"""Megatron-core 0.16.1's tensor_parallel names on tensorpar: helpers, tracker, seeds, recompute."""

import inspect

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tests.harness import run_on_ranks

WORLD_SIZES = [1, 2, 4]

# megatron/core/tensor_parallel/__init__.py's __all__ at core_v0.16.1.
MEGATRON_TENSOR_PARALLEL_ALL = [
    "vocab_parallel_cross_entropy", "broadcast_data", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes", "copy_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate", "linear_with_grad_accumulation_and_async_allreduce",
    "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "checkpoint", "convert_cuda_rng_state", "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed", "get_expert_parallel_rng_tracker_name", "is_graph_safe_cuda_rng_tracker",
    "CheckpointWithoutOutput", "split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks",
    "gather_split_1d_tensor",
]


def test_every_name_of_megatrons_tensor_parallel_is_a_top_level_name():
    assert [n for n in MEGATRON_TENSOR_PARALLEL_ALL if not hasattr(tp, n)] == []
    assert tp.CudaRNGStatesTracker is tp.RNGStatesTracker


def test_megatron_code_ports_by_changing_the_import_only():
    """``from megatron.core import tensor_parallel, parallel_state`` becomes ``from tensorpar import
    tensor_parallel, parallel_state``: the package has Megatron's ``__all__``, the names tp has, and
    its modules (layers, mappings, random, utils, data, cross_entropy)."""
    from tensorpar import parallel_state, tensor_parallel
    from tensorpar.tensor_parallel import cross_entropy, data, layers, mappings, random, utils  # noqa: F401

    assert sorted(tensor_parallel.__all__) == sorted(MEGATRON_TENSOR_PARALLEL_ALL)
    assert all(getattr(tensor_parallel, name) is getattr(tp, name) for name in MEGATRON_TENSOR_PARALLEL_ALL)
    assert parallel_state.initialize_model_parallel is tp.initialize_model_parallel


def test_signatures_take_megatrons_positional_arguments():
    seed = inspect.signature(tp.model_parallel_cuda_manual_seed).parameters
    assert list(seed)[:8] == ["seed", "te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng",
                              "tp_rank", "ep_rank", "etp_rank", "force_reset_rng"]
    init = inspect.signature(tp.initialize_model_parallel).parameters
    assert list(init)[:3] == ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                              "virtual_pipeline_model_parallel_size"]
    assert init["order"].default == "tp-cp-ep-dp-pp" and init["expert_tensor_parallel_size"].default is None
    assert init["backend"].kind is inspect.Parameter.KEYWORD_ONLY
    param = torch.nn.Parameter(torch.ones(2))
    tp.set_tensor_model_parallel_attributes(param, True, 0, 1)
    other = torch.ones(2)
    tp.copy_tensor_model_parallel_attributes(other, param)
    assert (other.tensor_model_parallel, other.partition_dim, other.partition_stride) == (True, 0, 1)
    bare = torch.ones(1)
    tp.set_defaults_if_not_set_tensor_model_parallel_attributes(bare)
    assert (bare.tensor_model_parallel, bare.partition_dim, bare.partition_stride) == (False, -1, 1)


def test_split_along_last_dim_and_vocab_ranges():
    x = torch.arange(24.0).view(2, 3, 4)
    parts = tp.split_tensor_along_last_dim(x, 2)
    assert [p.shape for p in parts] == [(2, 3, 2)] * 2 and torch.equal(torch.cat(parts, -1), x)
    assert not parts[0].is_contiguous() and tp.split_tensor_along_last_dim(x, 2, True)[0].is_contiguous()
    with pytest.raises(ValueError, match="last dimension"):
        tp.split_tensor_along_last_dim(x, 3)
    assert [tp.VocabUtility.vocab_range_from_global_vocab_size(1600, r, 8) for r in (0, 7)] == [(0, 200), (1400, 1600)]
    assert tp.VocabUtility.vocab_range_from_per_partition_vocab_size(50, 3, 4) == (150, 200)


def _one_d_body():
    tp.initialize_model_parallel(dist.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    x = torch.arange(12.0 * n).view(3, 4 * n)
    chunk = tp.split_tensor_into_1d_equal_chunks(x)
    assert torch.equal(chunk, x.reshape(-1)[r * 12:(r + 1) * 12])
    assert chunk.data_ptr() == x.reshape(-1)[r * 12:].data_ptr()            # a view ...
    copy = tp.split_tensor_into_1d_equal_chunks(x, new_buffer=True)
    assert torch.equal(copy, chunk) and copy.data_ptr() != chunk.data_ptr()  # ... or a copy
    assert torch.equal(tp.gather_split_1d_tensor(chunk), x.reshape(-1))
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_1d_chunks_gather_back_to_the_flattened_tensor(world_size):
    assert run_on_ranks(_one_d_body, world_size) == [True] * world_size


def _broadcast_body(tp_size):
    tp.initialize_model_parallel(tp_size)
    rank = dist.get_rank()
    src = tp.get_tensor_model_parallel_src_rank()
    data = None
    if tp.get_tensor_model_parallel_rank() == 0:
        data = {"tokens": torch.arange(6).view(2, 3) + 100 * rank, "scalar": torch.tensor(rank),
                "long": torch.full((1, 2, 1, 2), rank), "unused": torch.zeros(1)}
    got = tp.broadcast_data(["tokens", "scalar", "long"], data, torch.int64)
    assert torch.equal(got["tokens"], torch.arange(6).view(2, 3) + 100 * src)
    assert torch.equal(got["scalar"], torch.tensor(src)) and got["long"].shape == (1, 2, 1, 2)
    assert set(got) == {"tokens", "scalar", "long"}
    return int(got["long"].sum())


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_broadcast_data_gives_every_tp_rank_its_rank_zeros_batch(tp_size):
    results = run_on_ranks(_broadcast_body, 4, tp_size)
    assert results == [4 * (r // tp_size * tp_size) for r in range(4)]


def _broadcast_wrong_dtype_body():
    tp.initialize_model_parallel(1)
    with pytest.raises(TypeError, match="do not have datatype torch.int64"):
        tp.broadcast_data(["x"], {"x": torch.zeros(2)}, torch.int64)
    return True


def test_broadcast_data_names_a_wrong_dtype():
    assert run_on_ranks(_broadcast_wrong_dtype_body, 1) == [True]


def test_nested_forks_of_a_stream_continue_it_as_one_fork_would():
    tracker = tp.CudaRNGStatesTracker()
    tracker.add("a", 1234)
    tracker.add("b", 5678)
    nested_a, nested_b = [], []
    with tracker.fork("a"):
        nested_a.append(torch.randn(10))
        with tracker.fork("b"):
            nested_b.append(torch.randn(10))
            with tracker.fork("a"):
                nested_a.append(torch.randn(10))
            nested_b.append(torch.randn(10))
        nested_a.append(torch.randn(10))
    for drawn, seed in ((nested_a, 1234), (nested_b, 5678)):
        one_stream = torch.Generator().manual_seed(seed)
        assert all(torch.equal(d, torch.randn(10, generator=one_stream)) for d in drawn), seed
    # set_states replaces every stream (whatever it holds), reset forgets them.
    tracker.set_states({"c": 1234})
    assert tracker.get_states() == {"c": 1234} and tracker.states_ == {"c": 1234}
    tracker.reset()
    assert tracker.get_states() == {} and not tracker.is_initialized()
    with pytest.raises(ValueError, match="use_cudagraphable_rng=True"):
        tp.CudaRNGStatesTracker(use_cudagraphable_rng=True)
    assert not tp.is_graph_safe_cuda_rng_tracker(tracker)


def test_convert_cuda_rng_state_gives_state_tensors_and_refuses_graphable():
    generator = torch.Generator().manual_seed(3)
    assert torch.equal(tp.convert_cuda_rng_state(generator), generator.get_state())
    state = torch.get_rng_state()
    assert tp.convert_cuda_rng_state(state) is state
    with pytest.raises(ValueError, match="to_graphable=True"):
        tp.convert_cuda_rng_state(state, to_graphable=True)


def _megatron_seed_body():
    tp.initialize_model_parallel(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    tp.model_parallel_cuda_manual_seed(7, te_rng_tracker=True, force_reset_rng=True)
    states = tp.get_cuda_rng_tracker().get_states()
    ep, etp = tp.parallel_state.get_expert_model_parallel_rank(), tp.parallel_state.get_expert_tensor_parallel_rank()
    expected = {"data-parallel-rng": 7, "model-parallel-rng": 7 + 2718 + tp.get_tensor_model_parallel_rank(),
                "expert-parallel-rng": 7 + 1024 + 100 * ep + etp}
    for name, seed in expected.items():
        assert torch.equal(states[name], torch.Generator().manual_seed(seed).get_state()), name
    for flag in ("inference_rng_tracker", "use_cudagraphable_rng"):
        with pytest.raises(ValueError, match=f"{flag}=True"):
            tp.model_parallel_cuda_manual_seed(7, **{flag: True})
    # Explicit ranks need no groups.
    tp.destroy_model_parallel()
    tp.model_parallel_cuda_manual_seed(7, tp_rank=3, ep_rank=1, etp_rank=0)
    states = tp.get_cuda_rng_tracker().get_states()
    assert torch.equal(states["model-parallel-rng"], torch.Generator().manual_seed(7 + 2718 + 3).get_state())
    assert torch.equal(states["expert-parallel-rng"], torch.Generator().manual_seed(7 + 1024 + 100).get_state())
    return ep, etp


def test_model_parallel_cuda_manual_seed_makes_megatrons_three_streams():
    # TP=2 x DP=2; experts: EP=2 over consecutive ranks, ETP=1.
    assert run_on_ranks(_megatron_seed_body, 4) == [(0, 0), (1, 0), (0, 0), (1, 0)]


def _distributed_checkpoint_body():
    tp.initialize_model_parallel(dist.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    torch.manual_seed(0)  # the input is replicated over TP
    x0 = torch.randn(2 * n, 3)
    x = x0.clone().requires_grad_(True)
    y = tp.checkpoint(lambda a, b: torch.sin(a) * b, True, x, 2.0)
    # As Megatron: the caller's tensor now holds only this rank's 1-D shard ...
    assert x.shape == (6,) and torch.equal(x.detach(), x0.reshape(-1)[6 * r:6 * (r + 1)])
    y.sum().backward()
    # ... and is whole again after the backward, with the unsharded gradient.
    assert torch.equal(x.detach(), x0)
    torch.testing.assert_close(x.grad, 2.0 * torch.cos(x0), rtol=0, atol=0)
    # A view cannot change its data: it keeps its shape (only a copy of its shard is saved).
    base = x0.clone().requires_grad_(True)
    view = base[:]
    tp.checkpoint(torch.sin, True, view).sum().backward()
    assert view.shape == x0.shape
    torch.testing.assert_close(base.grad, torch.cos(x0), rtol=0, atol=0)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_distribute_saved_activations_shrinks_the_input_to_its_shard_until_backward(world_size):
    assert run_on_ranks(_distributed_checkpoint_body, world_size) == [True] * world_size


def _dropout_gelu(x):
    with tp.get_rng_tracker().fork():
        return torch.nn.functional.dropout(torch.nn.functional.gelu(x), 0.5)


def _without_output_body():
    tp.initialize_model_parallel(dist.get_world_size())
    torch.manual_seed(1)
    x0, g = torch.randn(8, 16), torch.randn(8, 16)
    grads = []
    for recompute in (False, True):
        tp.model_parallel_manual_seed(5)
        x = x0.clone().requires_grad_(True)
        if recompute:
            ckpt = tp.CheckpointWithoutOutput()
            h = ckpt.checkpoint(_dropout_gelu, x)
            y = h * x
            ckpt.discard_output_and_register_recompute(y)
            assert h.untyped_storage().size() == 0  # freed until y's gradient arrives
        else:
            y = _dropout_gelu(x) * x
        y.backward(g)
        grads.append((y.detach(), x.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (grads[0][0] == 0).any()  # dropout was on, and replayed
    with pytest.raises(ValueError, match="fp8=True"):
        tp.CheckpointWithoutOutput(fp8=True)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_checkpoint_without_output_frees_and_recomputes_the_output(world_size):
    assert run_on_ranks(_without_output_body, world_size) == [True] * world_size
