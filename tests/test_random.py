"""RNG tracker, TP-aware dropout and activation recompute on CPU ranks."""

import unittest.mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.tensor_parallel import keep_masks
from tensorpar.tensor_parallel.random import dropout
from tests.harness import run_on_ranks

WORLD_SIZES = [1, 2, 4]


def _all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _streams_body():
    tp.initialize_model_parallel(dist.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    tracker = tp.get_rng_tracker()
    tp.model_parallel_manual_seed(123)
    default = torch.rand(16)
    with tracker.fork():
        forked = torch.rand(16)
    after = torch.rand(16)
    # The default stream is the same on every rank and untouched by fork().
    for other in _all(default):
        torch.testing.assert_close(other, default, rtol=0, atol=0)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(16), default) and torch.equal(torch.rand(16), after)
    # The model-parallel stream differs per rank, and is seed + 2718 + tp_rank.
    everyone = _all(forked)
    assert all(not torch.equal(everyone[i], everyone[j]) for i in range(n) for j in range(i))
    assert torch.equal(forked, torch.rand(16, generator=torch.Generator().manual_seed(123 + 2718 + r)))
    # fork() continues the stream where it stopped; states round-trip.
    saved = tracker.get_states()
    with tracker.fork():
        second = torch.rand(16)
    assert not torch.equal(second, forked)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(16), second)
    # Megatron's streams beside it: data-parallel (the seed) and expert-parallel (ETP rank = TP rank here).
    assert set(saved) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    with tracker.fork(tp.get_data_parallel_rng_tracker_name()):
        assert torch.equal(torch.rand(16), torch.rand(16, generator=torch.Generator().manual_seed(123)))
    with tracker.fork(tp.get_expert_parallel_rng_tracker_name()):
        assert torch.equal(torch.rand(16), torch.rand(16, generator=torch.Generator().manual_seed(123 + 1024 + r)))
    # A block that raises still restores the default stream.
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with pytest.raises(KeyError):
        with tracker.fork():
            torch.rand(3)
            raise KeyError("inside")
    assert torch.equal(torch.rand(4), expected)
    # Bad use.
    with pytest.raises(ValueError, match="seed 7 is already used"):
        tracker.add("a", 7)
        tracker.add("b", 7)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 8)
    # set_states replaces every stream (Megatron's semantics).
    tracker.set_states({"nope": saved[tp.random.MODEL_PARALLEL_RNG]})
    assert set(tracker.get_states()) == {"nope"}
    tracker.reset()
    assert not tracker.is_initialized()
    with pytest.raises(RuntimeError, match="model_parallel_manual_seed"):
        with tracker.fork():
            pass
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_default_stream_shared_and_model_parallel_stream_per_rank(world_size):
    assert run_on_ranks(_streams_body, world_size) == [True] * world_size


def _dropout_body():
    tp.initialize_model_parallel(dist.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    s, b, h, p = 8 * n, 3, 16, 0.3
    x = torch.randn(s, b, h)
    tp.model_parallel_manual_seed(9)
    # Small blocks (3 rows), so that the ranks' edges cut blocks at every TP size.
    with unittest.mock.patch.object(keep_masks, "DROPOUT_BLOCK_ELEMENTS", 3 * b * h):
        replicated = dropout(x, p)
        # Replicated: every rank draws the same mask (the default stream is shared).
        for other in _all(replicated):
            assert torch.equal(other, replicated)
        tp.model_parallel_manual_seed(9)
        sharded = dropout(x.chunk(n, 0)[r], p, sequence_parallel=True)
    # The TP=1 mask, whatever the TP size: each rank's rows of it.
    torch.testing.assert_close(sharded, replicated.chunk(n, 0)[r], rtol=0, atol=0)
    # ... and the default stream stays in step across ranks afterwards.
    after = torch.rand(8)
    for other in _all(after):
        assert torch.equal(other, after)
    assert dropout(x, p, training=False) is x and dropout(x, 0.0) is x
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), got 1.0"):
        dropout(x, 1.0)
    return True


def _dropout_mask_size_body():
    """Item 7: under SP a rank draws (about) its own rows only and keeps only their mask."""
    from tests.op_counter import OpCounter

    tp.initialize_model_parallel(dist.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    s, b, h = 16 * n, 2, 32
    x = torch.randn(s // n, b, h, requires_grad=True)
    tp.model_parallel_manual_seed(3)
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes() if t.dtype == torch.bool else 0)
        return t

    with unittest.mock.patch.object(keep_masks, "DROPOUT_BLOCK_ELEMENTS", 3 * b * h), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), OpCounter() as ops:
        y = dropout(x, 0.5, sequence_parallel=True)
    drawn = ops.elements[torch.ops.aten.lt.Scalar_out] // (b * h)   # rows drawn
    assert max(saved) == x.numel()          # the mask kept for backward: this rank's rows only
    keep_fraction = (y != 0).float().mean().item()
    return drawn, keep_fraction


def test_sequence_parallel_dropout_draws_and_keeps_only_this_ranks_rows():
    # 16 local rows in blocks of 3: the edges' blocks are drawn whole, 16 + 2 * 2 rows at most,
    # where drawing the whole sequence would be 16 * TP.
    for world_size in (2, 4):
        for drawn, keep_fraction in run_on_ranks(_dropout_mask_size_body, world_size):
            assert 16 <= drawn <= 20
            assert 0.35 < keep_fraction < 0.65


def test_dropout_by_row_starts_gives_each_cp_rank_the_masks_of_its_global_rows():
    """A CP rank's rows are two chunks of the sequence: each row gets the mask CP=1 gives its
    position, in blocks of 2 rows that cross the chunks' edges, and the padding rows are dropped."""
    from tensorpar.context_parallel import SequenceChunks

    x = torch.randn(13, 2, 3)
    with unittest.mock.patch.object(keep_masks, "DROPOUT_BLOCK_ELEMENTS", 2 * 6):
        torch.manual_seed(5)
        full = dropout(x, 0.5)
        for cp in (2, 4):
            for rank in range(cp):
                chunks = SequenceChunks(13, cp, rank)
                torch.manual_seed(5)
                local = dropout(chunks.shard(x, dim=0, pad_value=1.0), 0.5, valid_rows=13,
                                row_starts=tuple(c * chunks.chunk_len for c in chunks.chunks()))
                assert torch.equal(local, chunks.shard(full, dim=0)), (cp, rank)
    with pytest.raises(ValueError, match=r"valid_rows must be an int in \[1, inf\] \(the full sequence's rows\), "
                                         "got None"):
        dropout(x[:12], 0.5, row_starts=(0, 8))


def _seed_before_initialize_body():
    with pytest.raises(RuntimeError, match="call tensorpar.initialize_model_parallel"):
        tp.model_parallel_manual_seed(1)
    tp.initialize_model_parallel(dist.get_world_size())
    tp.model_parallel_manual_seed(1)
    assert tp.get_cuda_rng_tracker() is tp.get_rng_tracker()
    return tp.get_rng_tracker()._devices[tp.random.MODEL_PARALLEL_RNG] == tp.parallel_state.default_device()


def test_get_cuda_rng_tracker_takes_megatrons_arguments():
    assert tp.get_cuda_rng_tracker(use_te_rng_tracker=True, inference_rng_tracker=False,
                                   use_cudagraphable_rng=False) is tp.get_rng_tracker()
    assert tp.get_cuda_rng_tracker(False, False, False) is tp.get_rng_tracker()
    for flags in (dict(inference_rng_tracker=True), dict(use_cudagraphable_rng=True)):
        with pytest.raises(ValueError, match="tensorpar has only the training tracker"):
            tp.get_cuda_rng_tracker(**flags)


def test_seeding_before_initialize_is_a_clear_error():
    """Item 4: no silent TP rank 0 (every rank's model-parallel stream alike)."""
    assert run_on_ranks(_seed_before_initialize_body, 2) == [True, True]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dropout_mask_matches_tp1_for_replicated_and_sequence_parallel(world_size):
    assert run_on_ranks(_dropout_body, world_size) == [True] * world_size


def _block(x, w, scale, p):
    """A toy block drawing from both streams and from the CPU generator."""
    h = dropout(x @ w, p)
    with tp.get_rng_tracker().fork():
        h = F.dropout(torch.tanh(h), p) * scale
    return h, h.sum(-1)


def _checkpoint_body():
    tp.initialize_model_parallel(dist.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    torch.manual_seed(0)
    x0, w0 = torch.randn(2 * n, 3, 8), torch.randn(8, 8)
    g0, g1 = torch.randn(2 * n, 3, 8), torch.randn(2 * n, 3)
    results = {}
    for mode in ("plain", "checkpoint", "distributed"):
        tp.model_parallel_manual_seed(42)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if mode == "plain":
            out, total = _block(x, w, 2.0, 0.5)
        else:
            out, total = tp.checkpoint(_block, mode == "distributed", x, w, 2.0, 0.5)
        # Backward (with its recompute) must not disturb the streams the forward left behind.
        torch.autograd.backward([out, total], [g0, g1])
        with tp.get_rng_tracker().fork():
            next_forked = torch.rand(4)
        results[mode] = (out.detach(), x.grad, w.grad, torch.rand(4), next_forked)
    for mode in ("checkpoint", "distributed"):
        for got, want in zip(results[mode], results["plain"]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (results["plain"][0] == 0).any()  # dropout really was on
    # A non-tensor-requiring input and a tensor output that needs no grad are fine.
    y = tp.checkpoint(lambda a, b: a * b, False, torch.ones(3, requires_grad=True), torch.ones(3))
    y.sum().backward()
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_checkpoint_recompute_reproduces_dropout_forward_and_grads(world_size):
    assert run_on_ranks(_checkpoint_body, world_size) == [True] * world_size


def _distributed_saves_a_slice_body():
    tp.initialize_model_parallel(dist.get_world_size())
    torch.manual_seed(0)  # the input must be replicated across TP ranks
    x = torch.randn(4, 2, 8, requires_grad=True)
    with tp.CommLedger() as ledger:
        y = tp.checkpoint(torch.sin, True, x)
        assert ledger.count() == 0
        y.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))
    return [(rec.op, rec.shape) for rec in ledger.records]


def test_distribute_saved_activations_all_gathers_the_input_once_in_backward():
    assert run_on_ranks(_distributed_saves_a_slice_body, 2) == [[("all_gather", (64,))]] * 2


def _autocast_block(x, w):
    out = x @ w
    assert out.dtype == torch.bfloat16, "the recompute must run under the forward's autocast"
    return out.float().tanh()


def test_checkpoint_recomputes_under_the_forwards_autocast():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct = _autocast_block(x, w)
    direct.sum().backward()
    expected = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        recomputed = tp.checkpoint(_autocast_block, False, x, w)
    recomputed.sum().backward()
    torch.testing.assert_close(recomputed, direct, rtol=0, atol=0)
    torch.testing.assert_close((x.grad, w.grad), expected, rtol=0, atol=0)
