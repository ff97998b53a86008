"""Each region mapping: forward and backward against the single-process computation."""

import pytest
import torch

import tensorpar as tp
from tests.harness import run_on_ranks

WORLD_SIZES = [1, 2, 4]


def _grad_through(mapping, x, grad_out, **kwargs):
    x = x.clone().requires_grad_(True)
    y = mapping(x, **kwargs)
    y.backward(grad_out)
    return y.detach(), x.grad


def _mappings_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    s, b, h = 4 * n, 2, 4 * n
    full = torch.randn(s, b, h)
    # Rank-dependent inputs, as partial sums / per-rank grads would be.
    per_rank = [torch.randn(s, b, h) for _ in range(n)]
    mine = per_rank[r]
    total = sum(per_rank)
    seq_chunks, hid_chunks = full.chunk(n, 0), full.chunk(n, -1)

    # f: identity forward, all-reduce backward.
    y, gx = _grad_through(tp.copy_to_tensor_model_parallel_region, full, mine)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, total)
    # g: all-reduce forward, identity backward.
    y, gx = _grad_through(tp.reduce_from_tensor_model_parallel_region, mine, full)
    torch.testing.assert_close(y, total)
    torch.testing.assert_close(gx, full)
    partial = mine.clone().requires_grad_(True)
    summed = tp.reduce_from_tensor_model_parallel_region(partial * 1, inplace=True)
    torch.testing.assert_close(summed, total)
    summed.backward(full)
    torch.testing.assert_close(partial.grad, full)
    # scatter last dim / gather last dim.
    y, gx = _grad_through(tp.scatter_to_tensor_model_parallel_region, full, hid_chunks[r])
    torch.testing.assert_close(y, hid_chunks[r])
    torch.testing.assert_close(gx, full)
    y, gx = _grad_through(tp.gather_from_tensor_model_parallel_region, hid_chunks[r], full)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, hid_chunks[r])
    # sequence scatter / gather (with and without reduce-scatter backward).
    y, gx = _grad_through(tp.scatter_to_sequence_parallel_region, full, seq_chunks[r])
    torch.testing.assert_close(y, seq_chunks[r])
    torch.testing.assert_close(gx, full)
    y, gx = _grad_through(tp.gather_from_sequence_parallel_region, seq_chunks[r], mine)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, total.chunk(n, 0)[r])
    y, gx = _grad_through(tp.gather_from_sequence_parallel_region, seq_chunks[r], full,
                          tensor_parallel_output_grad=False)
    torch.testing.assert_close(gx, seq_chunks[r])
    y, gx = _grad_through(tp.reduce_scatter_to_sequence_parallel_region, mine, seq_chunks[r])
    torch.testing.assert_close(y, total.chunk(n, 0)[r])
    torch.testing.assert_close(gx, full)
    # g and the SP reduce-scatter started without waiting: the same values and grads once waited.
    for sp, expected, grad in ((False, total, full), (True, total.chunk(n, 0)[r], seq_chunks[r])):
        y, gx = _grad_through(lambda x: tp.start_reduction_from_tensor_model_parallel_region(
            x * 1, sequence_parallel=sp, then=lambda t: t * 2).wait(), mine, grad)
        torch.testing.assert_close(y, 2 * expected)
        torch.testing.assert_close(gx, 2 * (full if sp else grad))
    # last-dim all-gather (backward reduce-scatter) and reduce-scatter (backward all-gather).
    y, gx = _grad_through(tp.all_gather_last_dim_from_tensor_parallel_region, hid_chunks[r], mine)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, total.chunk(n, -1)[r])
    y, gx = _grad_through(tp.reduce_scatter_last_dim_to_tensor_parallel_region, mine, hid_chunks[r])
    torch.testing.assert_close(y, total.chunk(n, -1)[r])
    torch.testing.assert_close(gx, full)
    # The group is the second positional argument of every mapping but the sequence gather
    # (DESIGN.md's contract; that one follows Megatron, see its own test).
    group = tp.get_tensor_model_parallel_group()
    for mapping, x, expected in ((tp.scatter_to_sequence_parallel_region, full, seq_chunks[r]),
                                 (tp.reduce_scatter_to_sequence_parallel_region, mine, total.chunk(n, 0)[r]),
                                 (tp.gather_from_tensor_model_parallel_region, hid_chunks[r], full)):
        torch.testing.assert_close(mapping(x, group), expected)
    # all-to-all between sequence-parallel and hidden-parallel layouts, and its inverse.
    tokens = full.reshape(-1, h)
    sp = tokens.chunk(n, 0)[r]
    hp = tp.all_to_all_sp2hp(sp)
    torch.testing.assert_close(hp, tokens.chunk(n, -1)[r])
    torch.testing.assert_close(tp.all_to_all_hp2sp(hp), sp)
    x = sp.clone().requires_grad_(True)
    tp.all_to_all_sp2hp(x).backward(tokens.chunk(n, -1)[r] * 2)
    torch.testing.assert_close(x.grad, sp * 2)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mappings_forward_and_backward(world_size):
    assert run_on_ranks(_mappings_body, world_size) == [True] * world_size


def _megatron_order_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    group = tp.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    full, grad = torch.randn(2 * n, 3), torch.randn(n, 2 * n, 3)[r]
    shard = full.chunk(n, 0)[r]
    # Ported Megatron calls: f(x, False) keeps this rank's gradient slice, no reduce-scatter.
    y, gx = _grad_through(lambda x: tp.gather_from_sequence_parallel_region(x, False), shard, grad)
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(gx, grad.chunk(n, 0)[r])
    summed = comm_sum(grad).chunk(n, 0)[r]
    y, gx = _grad_through(lambda x: tp.gather_from_sequence_parallel_region(x, True, group), shard, grad)
    torch.testing.assert_close(gx, summed)
    # The old group-second call still works, with a warning naming the new order.
    with pytest.warns(FutureWarning, match="tensor_parallel_output_grad"):
        y, gx = _grad_through(lambda x: tp.gather_from_sequence_parallel_region(x, group), shard, grad)
    torch.testing.assert_close(gx, summed)
    # all_to_all(group, input_, output_split_sizes_, input_split_sizes): rank s sends (s+1)(d+1)
    # rows to rank d, each row holding (s, d); the backward returns every row's grad to its sender.
    sends = [[(s + 1) * (d + 1) for d in range(n)] for s in range(n)]
    rows = torch.cat([torch.tensor([[r, d]] * sends[r][d], dtype=torch.float32) for d in range(n)])
    expected = torch.cat([torch.tensor([[s, r]] * sends[s][r], dtype=torch.float32) for s in range(n)])
    y, gx = _grad_through(lambda x: tp.all_to_all(group, x, output_split_sizes_=[sends[s][r] for s in range(n)],
                                                  input_split_sizes=sends[r]), rows, 10 * expected)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(gx, 10 * rows)
    return True


def comm_sum(t):
    t = t.clone()
    torch.distributed.all_reduce(t)
    return t


def test_gather_from_sequence_parallel_region_takes_megatron_positional_order():
    assert run_on_ranks(_megatron_order_body, 2) == [True, True]


def _copy_to_inplace_grad_body():
    tp.initialize_model_parallel(2)
    x = torch.randn(4, 3, requires_grad=True)
    weight = torch.randn(5, 3)
    ptrs = {}
    results = []
    x.register_hook(lambda g: ptrs.__setitem__("out", g.data_ptr()))
    for inplace_grad in (False, True):
        x.grad = None
        y = tp.copy_to_tensor_model_parallel_region(x, inplace_grad=inplace_grad)
        y.register_hook(lambda g: ptrs.__setitem__("in", g.data_ptr()))
        (y @ weight.t()).backward(torch.ones(4, 5))
        results.append(x.grad.clone())
        # f's backward returns the very buffer it received (no copy) only with inplace_grad.
        assert (ptrs["in"] == ptrs["out"]) == inplace_grad, inplace_grad
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], comm_sum(torch.ones(4, 5) @ weight))
    return True


def test_copy_to_region_sums_a_fresh_gradient_in_place():
    assert run_on_ranks(_copy_to_inplace_grad_body, 2) == [True, True]


def _ledger_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    x = torch.randn(2 * n, 3, 8, requires_grad=True)
    with tp.CommLedger() as ledger:
        with ledger.phase("forward"):
            y = tp.gather_from_sequence_parallel_region(x)
        with ledger.phase("backward"):
            y.sum().backward()
    return [(rec.op, rec.phase, rec.shape, rec.bytes, rec.bytes_sent_per_rank) for rec in ledger.records]


def test_ledger_records_full_tensor_bytes_and_ring_volume():
    (records, _) = run_on_ranks(_ledger_body, 2)
    assert records == [("all_gather", "forward", (8, 3, 8), 8 * 3 * 8 * 4, 8 * 3 * 8 * 4 / 2),
                       ("reduce_scatter", "backward", (8, 3, 8), 8 * 3 * 8 * 4, 8 * 3 * 8 * 4 / 2)]


def test_ledger_records_nothing_for_one_rank():
    assert run_on_ranks(_ledger_body, 1) == [[]]


def _indivisible_sequence_body():
    tp.initialize_model_parallel(2)
    with pytest.raises(ValueError, match=r"\(5\) is not divisible by the tensor-parallel size \(2\)"):
        tp.scatter_to_sequence_parallel_region(torch.randn(5, 2, 4))
    return True


def test_sequence_not_divisible_by_tp_is_a_clear_error():
    assert run_on_ranks(_indivisible_sequence_body, 2) == [True, True]


def test_mapping_before_initialize_is_a_clear_error():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        tp.copy_to_tensor_model_parallel_region(torch.randn(2))


def _uneven_body():
    """Every gather/scatter mapping with per-rank sizes (rank r: r + 1, rank 1 empty at TP 4)."""
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    sizes = [q + 1 for q in range(n)]
    if n == 4:
        sizes[1] = 0
    torch.manual_seed(0)
    total_size = sum(sizes)
    full_seq, full_hid = torch.randn(total_size, 2, 3), torch.randn(2, 3, total_size)
    per_rank = [torch.randn(total_size, 2, 3) for _ in range(n)]
    start, size = sum(sizes[:r]), sizes[r]
    my_seq, my_hid = full_seq[start:start + size], full_hid[..., start:start + size]
    # name, mapping, input, expected output, output grad, expected input grad
    cases = (
        ("scatter last", tp.scatter_to_tensor_model_parallel_region, full_hid, my_hid, my_hid * 2,
         torch.cat([full_hid[..., sum(sizes[:q]):sum(sizes[:q + 1])] * 2 for q in range(n)], -1)),
        ("gather last", tp.gather_from_tensor_model_parallel_region, my_hid, full_hid, full_hid * 3, my_hid * 3),
        ("scatter seq", tp.scatter_to_sequence_parallel_region, full_seq, my_seq, my_seq, full_seq),
        ("gather seq", tp.gather_from_sequence_parallel_region, my_seq, full_seq, per_rank[r],
         sum(per_rank)[start:start + size]),
        ("reduce-scatter seq", tp.reduce_scatter_to_sequence_parallel_region, per_rank[r],
         sum(per_rank)[start:start + size], my_seq, full_seq),
    )
    for name, mapping, x, expected, grad, expected_grad in cases:
        y, gx = _grad_through(mapping, x, grad, sizes=sizes)
        torch.testing.assert_close(y, expected, msg=lambda m: f"{name} output, sizes {sizes}: {m}")
        torch.testing.assert_close(gx, expected_grad, msg=lambda m: f"{name} input grad, sizes {sizes}: {m}")
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mappings_with_unequal_sizes(world_size):
    assert run_on_ranks(_uneven_body, world_size) == [True] * world_size


def _uneven_ledger_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    r = tp.get_tensor_model_parallel_rank()
    with tp.CommLedger() as ledger:
        tp.gather_from_sequence_parallel_region(torch.ones(3 - r, 2), sizes=[3, 2])
    return [(rec.op, rec.shape) for rec in ledger.records]


def test_unequal_gather_travels_padded_to_the_largest_shard():
    assert run_on_ranks(_uneven_ledger_body, 2) == [[("all_gather", (6, 2))]] * 2
