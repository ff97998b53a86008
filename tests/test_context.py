"""Context parallelism (tensorpar.context_parallel): the sequence chunks, and Ulysses (a2a) and ring (p2p)
attention against unsharded causal SDPA at CP 1, 2, 4: outputs and q/k/v gradients, GQA, K/V
heads fewer than CP, heads CP does not divide, lengths 2 x CP does not divide (padding), and
the collectives CommLedger records."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensorpar import CommLedger
from tensorpar.context_parallel import SequenceChunks, context_attention, head_split, natural_order
from tensorpar.planning.context import attention_comm
from tests.harness import run_on_ranks

_GROUPS: dict = {}


def _cp_group(tp_size: int):
    """This rank's CP group with TP fastest (Megatron's order): ranks ``r % tp_size`` alike."""
    world = dist.get_world_size()
    if tp_size not in _GROUPS:
        # Every rank creates every group, in one order.
        groups = [dist.new_group(list(range(t, world, tp_size))) for t in range(tp_size)]
        _GROUPS[tp_size] = groups[dist.get_rank() % tp_size]
    return _GROUPS[tp_size]


def test_chunks_pair_chunk_i_with_2cp_minus_1_minus_i_and_pad_any_length():
    chunks = [SequenceChunks(11, 2, r) for r in range(2)]
    assert (chunks[0].chunk_len, chunks[0].padded_len, chunks[0].padding) == (3, 12, 1)
    assert chunks[0].positions().tolist() == [0, 1, 2, 9, 10, 11]
    assert chunks[1].positions().tolist() == [3, 4, 5, 6, 7, 8]
    x = torch.arange(22).view(2, 11)
    assert chunks[0].shard(x, dim=1, pad_value=-100)[0].tolist() == [0, 1, 2, 9, 10, -100]
    held = torch.cat([c.positions() for c in chunks])
    assert held[natural_order(2, 3)].tolist() == list(range(12))
    assert SequenceChunks(5, 1, 0).positions().tolist() == [0, 1, 2, 3, 4, 5]
    assert SequenceChunks(5, 2, 1, multiple=2).positions().tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\), got 2"):
        SequenceChunks(8, 2, 2)
    with pytest.raises(ValueError, match="not the sequence length 11"):
        chunks[0].shard(x, dim=0)


@pytest.mark.parametrize("causal", [True, False])
def test_a_long_block_pair_is_computed_in_query_tiles_with_the_untiled_results(monkeypatch, causal):
    """The ring's block attention takes a long pair's queries a few rows at a time (bounded fp32
    scores): outputs, log-sum-exps and q/k/v gradients are the whole softmax's."""
    from tensorpar.context_parallel import blockwise

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 2, 12, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 1, 12, 4, generator=g, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn(1, 2, 2, 12, 4, generator=g, dtype=torch.float64)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    scores = q_ @ k_.transpose(-1, -2) * 0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    reference = scores.softmax(-1) @ v_
    reference.backward(grad_out)
    monkeypatch.setattr(blockwise, "SCORE_TILE", 40)  # 3 query rows of 12 keys a tile: 4 tiles
    assert blockwise.query_rows(12, 12) == 3
    out, lse = blockwise.block_attention(q, k, v, scale=0.5, causal=causal)
    torch.testing.assert_close(out, reference.detach().float())
    torch.testing.assert_close(lse, scores.logsumexp(-1).detach().float())
    grads = blockwise.block_attention_backward(q, k, v, grad_out.float(), lse, (grad_out * out).sum(-1).float(),
                                               scale=0.5, causal=causal)
    for got, expected in zip(grads, (q_.grad, k_.grad, v_.grad)):
        torch.testing.assert_close(got, expected.float())


def test_ulysses_head_split_is_balanced_with_the_kv_heads_each_rank_reads():
    assert head_split(4, 2, 4) == [(0, 1, 0, 1), (1, 2, 0, 1), (2, 3, 1, 2), (3, 4, 1, 2)]
    assert head_split(3, 3, 2) == [(0, 2, 0, 2), (2, 3, 2, 3)]
    with pytest.raises(ValueError, match="at least one query head per CP rank: 2 heads at CP 4"):
        head_split(2, 1, 4)
    # A TP rank's heads 0-2 of 6 with 3 K/V heads (TP 2): heads 0, 1 read K/V head 0, head 2 reads 1.
    assert head_split(3, 2, 2, kv_of_head=[0, 0, 1]) == [(0, 2, 0, 1), (2, 3, 1, 2)]
    with pytest.raises(ValueError, match=r"kv_of_head \[1, 0\] must name, in non-decreasing order"):
        head_split(2, 2, 2, kv_of_head=[1, 0])


def _gather_body(seq_len: int):
    group = _cp_group(1)
    chunks = SequenceChunks.of(seq_len, cp_group=group)
    torch.manual_seed(0)
    full, weight = torch.randn(seq_len, 2, 3), torch.randn(seq_len, 2, 3)
    local = chunks.shard(full, dim=0).requires_grad_()
    gathered = chunks.gather(local, dim=0, cp_group=group)
    (gathered * weight).sum().backward()
    torch.testing.assert_close(gathered, full, rtol=0, atol=0)
    torch.testing.assert_close(local.grad, chunks.shard(weight, dim=0), rtol=0, atol=0)
    return True


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_gather_undoes_shard_and_its_backward_keeps_this_ranks_share(cp):
    assert all(run_on_ranks(_gather_body, cp, 7))


def _attention_body(mode: str, heads: int, kv_heads: int, seq_len: int, tp_size: int):
    group = _cp_group(tp_size)
    torch.manual_seed(10 + dist.get_rank() % tp_size)      # each CP group its own data
    b, d = 2, 8
    q, k, v = (torch.randn(b, h, seq_len, d, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(b, heads, seq_len, d)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    reference.backward(grad)
    chunks = SequenceChunks.of(seq_len, cp_group=group)
    local = [chunks.shard(t.detach(), dim=2).requires_grad_() for t in (q, k, v)]
    with CommLedger() as ledger:
        with ledger.phase("forward"):
            out = context_attention(*local, comm_type=mode, cp_group=group)
        with ledger.phase("backward"):
            out.backward(chunks.shard(grad, dim=2))
    torch.testing.assert_close(chunks.gather(out.detach(), dim=2, cp_group=group), reference.detach())
    for mine, full in zip(local, (q, k, v)):
        torch.testing.assert_close(chunks.gather(mine.grad, dim=2, cp_group=group), full.grad)
    return [(r.op, r.phase, r.bytes, r.group_size) for r in ledger.records]


def _expected_records(mode: str, heads: int, kv_heads: int, seq_len: int, cp: int, rank: int) -> list:
    """What CP rank ``rank``'s ledger must hold: ``(op, phase, bytes, group size)`` in order, as
    the communication model predicts them (an all-to-all records the tensor the rank sends: its
    own size under unequal splits)."""
    if cp == 1:
        return []
    comm = attention_comm(heads=heads, kv_heads=kv_heads, head_dim=8, batch=2,  # b = 2, d = 8, fp32
                          local_len=SequenceChunks(seq_len, cp, 0).local_len, cp=cp, cp_rank=rank, comm_type=mode,
                          dtype=torch.float32)
    return [(op.op, op.phase, op.bytes, op.group_size) for op in comm.forward + comm.backward]


def _check_records(records: list, mode: str, heads: int, kv_heads: int, seq_len: int, cp: int, tp: int = 1):
    for rank, got in enumerate(records):
        assert got == _expected_records(mode, heads, kv_heads, seq_len, cp, rank // tp), (rank, got)


CASES = [(mode, cp, heads, kv) for mode in ("a2a", "p2p") for cp in (1, 2, 4) for heads, kv in ((4, 2), (4, 1))]


@pytest.mark.parametrize("mode,cp,heads,kv_heads", CASES)
def test_context_attention_equals_unsharded_causal_sdpa_with_gqa_and_padding(mode, cp, heads, kv_heads):
    # 11 tokens: 2 x CP divides it at no CP size, so every case pads.
    _check_records(run_on_ranks(_attention_body, cp, mode, heads, kv_heads, 11, 1), mode, heads, kv_heads, 11, cp)


@pytest.mark.parametrize("mode,cp,heads,kv_heads,seq_len", [
    ("a2a", 4, 6, 2, 9),    # 2, 2, 1, 1 query heads; K/V head 0 on ranks 0-1, head 1 on ranks 1-3
    ("a2a", 2, 3, 3, 8),    # 3 heads over 2 ranks
    ("a2a", 4, 5, 1, 8),    # one K/V head replicated on every rank
    ("p2p", 4, 6, 2, 9),
])
def test_context_attention_with_heads_cp_does_not_divide(mode, cp, heads, kv_heads, seq_len):
    _check_records(run_on_ranks(_attention_body, cp, mode, heads, kv_heads, seq_len, 1), mode, heads, kv_heads,
                   seq_len, cp)


@pytest.mark.parametrize("mode", ["a2a", "p2p"])
def test_context_attention_in_cp_groups_of_non_consecutive_ranks(mode):
    # TP 2 x CP 2 in Megatron's order: the CP groups are ranks {0, 2} and {1, 3}.
    _check_records(run_on_ranks(_attention_body, 4, mode, 4, 2, 7, 2), mode, 4, 2, 7, 2, tp=2)
