"""RNG tracker, TP-aware dropout and activation recompute on CPU ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.random import dropout
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
    # The alias is the same function.
    assert tp.model_parallel_cuda_manual_seed is tp.model_parallel_manual_seed
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
    with pytest.raises(ValueError, match="unknown RNG streams"):
        tracker.set_states({"nope": saved[tp.random.MODEL_PARALLEL_RNG]})
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
    s, b, h, p = 4 * n, 3, 16, 0.3
    x = torch.randn(s, b, h)
    tp.model_parallel_manual_seed(9)
    replicated = dropout(x, p)
    # The mask TP=1 draws: any TP size, any rank, replicated or sequence-parallel, gets it.
    torch.manual_seed(9)
    keep = torch.empty(s, b, h, dtype=torch.bool).bernoulli_(1 - p)
    torch.testing.assert_close(replicated, x * keep / (1 - p), rtol=0, atol=0)
    tp.model_parallel_manual_seed(9)
    sharded = dropout(x.chunk(n, 0)[r], p, sequence_parallel=True)
    torch.testing.assert_close(sharded, replicated.chunk(n, 0)[r], rtol=0, atol=0)
    # ... and the default stream stays in step across ranks afterwards.
    after = torch.rand(8)
    for other in _all(after):
        assert torch.equal(other, after)
    assert dropout(x, p, training=False) is x and dropout(x, 0.0) is x
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), got 1.0"):
        dropout(x, 1.0)
    return True


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
