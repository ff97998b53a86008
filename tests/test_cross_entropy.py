"""vocab_parallel_cross_entropy against F.cross_entropy on the full logits, at TP = 1, 2, 4."""

import pytest
import torch
import torch.nn.functional as F

import tensorpar as tp
from tests.harness import run_on_ranks

WORLD_SIZES = [1, 2, 4]
PADDED_VOCAB = 12  # 3 columns per rank at TP=4


def _reference(full_logits, target, weights, vocab_size, **kwargs):
    """Loss and full-logits grad from F.cross_entropy on the real (unpadded) columns."""
    logits = full_logits.detach().float().requires_grad_(True)
    loss = F.cross_entropy(logits[..., :vocab_size].flatten(0, -2), target.flatten(),
                           reduction="none", **kwargs).view(target.shape)
    loss.backward(weights)
    return loss.detach(), logits.grad


def _sharded(full_logits, target, weights, **kwargs):
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    shard = full_logits.chunk(n, dim=-1)[r].clone().requires_grad_(True)
    untouched = shard.detach().clone()
    loss = tp.vocab_parallel_cross_entropy(shard, target, **kwargs)
    loss.backward(weights)
    assert torch.equal(shard.detach(), untouched), "the caller's logits were modified"
    return loss.detach(), shard.grad


def _targets(shape, vocab_size, ignore_index):
    target = torch.randint(0, vocab_size, shape)
    flat = target.view(-1)
    flat[0], flat[-1] = vocab_size - 1, 0  # the last real column and the first
    flat[1] = ignore_index
    return target


def _cross_entropy_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    cases = 0
    # Sequence-first [s, b] tokens and a flat token list; vocab 5 leaves whole ranks padded at TP=4.
    for shape in ((3, 2), (7,)):
        for vocab_size in (None, 10, 5):
            real = vocab_size or PADDED_VOCAB
            for smoothing in (0.0, 0.1, 1.0):
                for ignore_index in (-100, 2):
                    full = torch.randn(*shape, PADDED_VOCAB) * 3
                    target = _targets(shape, real, ignore_index)
                    weights = torch.rand(shape)
                    kwargs = dict(label_smoothing=smoothing, ignore_index=ignore_index)
                    ref_loss, ref_grad = _reference(full, target, weights, real, **kwargs)
                    loss, grad = _sharded(full, target, weights, vocab_size=vocab_size, **kwargs)
                    assert loss.dtype == torch.float32 and loss.shape == target.shape
                    torch.testing.assert_close(loss, ref_loss)
                    torch.testing.assert_close(grad, ref_grad.chunk(n, dim=-1)[r])
                    ignored = target == ignore_index
                    assert torch.all(loss[ignored] == 0) and torch.all(grad[ignored] == 0)
                    cases += 1

    # bf16 logits: fp32 loss from the bf16 values, a bf16 grad.
    full = (torch.randn(4, 2, PADDED_VOCAB) * 3).bfloat16()
    target = _targets((4, 2), 10, -100)
    weights = torch.rand(4, 2)
    for smoothing in (0.0, 0.1):
        ref_loss, ref_grad = _reference(full, target, weights, 10, label_smoothing=smoothing)
        loss, grad = _sharded(full, target, weights, vocab_size=10, label_smoothing=smoothing)
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad.chunk(n, dim=-1)[r].bfloat16())
        cases += 1

    # An explicit group, and a loss reduced the usual way.
    full = torch.randn(5, PADDED_VOCAB)
    target = _targets((5,), PADDED_VOCAB, -100)
    shard = full.chunk(n, dim=-1)[r].clone().requires_grad_(True)
    loss = tp.vocab_parallel_cross_entropy(shard, target, 0.0, -100, tp.get_tensor_model_parallel_group())
    loss.mean().backward()
    ref = full.clone().requires_grad_(True)
    F.cross_entropy(ref, target, reduction="none").mean().backward()
    torch.testing.assert_close(shard.grad, ref.grad.chunk(n, dim=-1)[r])
    return cases + 1


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cross_entropy_matches_full_logits(world_size):
    assert run_on_ranks(_cross_entropy_body, world_size) == [2 * 3 * 3 * 2 + 3] * world_size


def _errors_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    logits = torch.randn(2, 3, PADDED_VOCAB // n)
    target = torch.zeros(2, 3, dtype=torch.long)
    for bad, vocab_size in ((PADDED_VOCAB, None), (-1, None), (10, 10), (11, 10)):
        target[1, 1] = bad
        with pytest.raises(ValueError, match=rf"target value {bad} is out of range for vocab_size "
                                             rf"{vocab_size or PADDED_VOCAB}"):
            tp.vocab_parallel_cross_entropy(logits, target, vocab_size=vocab_size)
    target[1, 1] = -100
    tp.vocab_parallel_cross_entropy(logits, target)
    with pytest.raises(ValueError, match="vocab_size"):
        tp.vocab_parallel_cross_entropy(logits, target, vocab_size=PADDED_VOCAB + 1)
    with pytest.raises(ValueError, match="target of shape"):
        tp.vocab_parallel_cross_entropy(logits, target[:1])
    with pytest.raises(ValueError, match="label_smoothing"):
        tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(TypeError, match="integer"):
        tp.vocab_parallel_cross_entropy(logits, target.float())
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_targets_raise(world_size):
    assert run_on_ranks(_errors_body, world_size) == [True] * world_size


def _ledger_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    target = torch.randint(0, PADDED_VOCAB, (4, 3))
    records = {}
    for smoothing in (0.0, 0.1):
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(4, 3, PADDED_VOCAB).chunk(n, dim=-1)[r].to(dtype).requires_grad_(True)
            with tp.CommLedger() as ledger:
                with ledger.phase("forward"):
                    loss = tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)
                with ledger.phase("backward"):
                    loss.sum().backward()
            records[smoothing, dtype] = [(rec.op, rec.phase, rec.reduce_op, rec.shape, rec.dtype, rec.bytes)
                                         for rec in ledger.records]
    return records


def test_cross_entropy_collectives_at_tp2():
    records, _ = run_on_ranks(_ledger_body, 2)
    tokens = 4 * 3
    for (smoothing, _dtype), got in records.items():
        stats = 3 if smoothing else 2
        assert got == [
            ("all_reduce", "forward", "max", (4, 3), torch.float32, 4 * tokens),
            ("all_reduce", "forward", "sum", (stats, 4, 3), torch.float32, 4 * stats * tokens),
        ]


def _hot_path_body(read_back: bool):
    """Items 8 and 9: no host sync (the range check is asynchronous off CPU) and one fp32 copy
    of the logits, worked on in place."""
    import unittest.mock

    from tests.op_counter import OpCounter

    tp.initialize_model_parallel(torch.distributed.get_world_size())
    torch.manual_seed(0)
    logits = torch.randn(4, 2, 5, dtype=torch.bfloat16, requires_grad=True)
    original = logits.detach().clone()
    target = torch.randint(0, 9, (4, 2))
    target[0, 0] = -100
    with unittest.mock.patch("tensorpar.errors._reads_back", lambda t: read_back):
        with OpCounter(big=logits.numel()) as ops:
            tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1, vocab_size=9)
        assert torch.equal(logits.detach(), original)        # the caller's logits untouched
        bad = target.clone()
        bad[1, 1] = 10
        with pytest.raises((ValueError, RuntimeError), match="out of range for vocab_size 9"):
            tp.vocab_parallel_cross_entropy(logits, bad, vocab_size=9)
    return ops.host_syncs, ops.fresh_big_results


def test_cross_entropy_forward_makes_one_vocab_sized_copy_and_no_host_sync_off_cpu():
    assert run_on_ranks(_hot_path_body, 2, False) == [(0, 1)] * 2
    # On CPU (or with TENSORPAR_DEBUG=1) the check reads the range back to name the bad value.
    assert run_on_ranks(_hot_path_body, 2, True) == [(2, 1)] * 2
