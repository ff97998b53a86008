"""The TP-invariant layers over a block count that TP sizes other than powers of two divide
(issue 30): ``ColumnLinear``/``RowLinear`` with ``blocks=24`` give the same bits at TP 1, 2, 3,
4 and 6, where TP 3's and TP 6's ranks hold blocks that are not one subtree of the blocks' tree
and exchange each subtree's partial sum (``tree_reduce.subtree_sums``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensorpar import invariant
from tensorpar.tree_reduce import HalvingTree, subtree_sums, subtrees, tree_sum
from tests.harness import run_on_ranks

SIZES = (1, 2, 3, 4, 6)


def test_subtrees_cover_a_ranks_blocks_with_the_fewest_nodes_of_the_one_tree():
    """tree_sum over 24 parts: chains of 3, then pairwise (HalvingTree's tree); each TP size's
    ranges split into its nodes, whose sums (added in that tree) are the whole sum's bits."""
    parts = [torch.randn(16, generator=torch.Generator().manual_seed(i)) * 10.0 ** (i % 5) for i in range(24)]
    whole = tree_sum(p.clone() for p in parts)
    streamed = HalvingTree(leaves=24)
    assert torch.equal([streamed.add(p.clone()) for p in parts][-1], whole)
    assert not torch.equal(sum(p.clone() for p in parts), whole)  # parts whose order shows
    assert [subtrees(8 * r, 8, 24) for r in range(3)] == [[(0, 6), (6, 2)], [(8, 1), (9, 3), (12, 3), (15, 1)],
                                                          [(16, 1), (17, 1), (18, 6)]]
    assert [subtrees(12 * r, 12, 24) for r in range(2)] == [[(0, 12)], [(12, 12)]]
    # TP 3's ranks' node sums, added in the tree's order by hand.
    nodes = [subtree_sums([p.clone() for p in parts[8 * r:8 * r + 8]], first=8 * r, leaves=24) for r in range(3)]
    (a, b), (c, d, e, f), (g, h, i) = nodes
    chain_2, chain_5 = b.clone().add_(c), f.clone().add_(g).add_(h)   # (l6 + l7) + l8, (l15 + l16) + l17
    by_hand = (a.clone().add_(chain_2.add_(d))).add_(e.clone().add_(chain_5).add_(i))
    assert torch.equal(by_hand, whole)


def _mine(t: torch.Tensor, n: int, pieces: int, split: bool = True) -> torch.Tensor:
    """This rank's part at TP ``n`` of each of ``t``'s ``pieces`` (dim 0), or all of it (``split`` False, TP 1)."""
    if n == 1 or not split:
        return t
    return torch.cat([piece.chunk(n)[dist.get_rank()] for piece in t.chunk(pieces)])


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _layers_body(sp: bool, dtype: str):
    """Column (stride 2) -> SwiGLU -> Row over 24 blocks at each TP size (Llama's MLP): every rank's
    output, input grad and weight/bias grads, and the invariant grad norm; plus TP 1's errors
    against F.linear. 192 features: a multiple of 16 on every rank, so the elementwise SwiGLU
    runs every element in the same SIMD lane path (at 24 a rank's last 8 take the tail loop's
    other bits)."""
    from tensorpar import grads

    rank, results = dist.get_rank(), {}
    groups = {n: dist.new_group(list(range(n))) for n in SIZES[1:]}
    groups[1] = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # TP 1 on every rank
    torch.manual_seed(0)
    x = torch.randn(24, 2, 48)
    w1, b1 = torch.randn(2 * 192, 48) / 7, torch.randn(2 * 192)
    w2, b2 = torch.randn(48, 192) / 14, torch.randn(48)
    grad = torch.randn(24, 2, 48)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    for n in SIZES:
        if rank >= n > 1:
            continue
        column = invariant.ColumnLinear(48, 2 * 192, stride=2, blocks=24, sequence_parallel=sp and n > 1,
                                        tp_group=groups[n], device="cpu")
        row = invariant.RowLinear(192, 48, blocks=24, input_is_parallel=True, sequence_parallel=sp and n > 1,
                                  tp_group=groups[n], device="cpu")
        with torch.no_grad():
            column.weight.copy_(_mine(w1, n, 2))
            column.bias.copy_(_mine(b1, n, 2))
            row.weight.copy_(_mine(w2.t(), n, 1).t())
            row.bias.copy_(b2)
        x_local = _mine(x, n, 1, sp).clone().requires_grad_()
        with autocast:
            y, _ = row(_swiglu(column(x_local)[0]))
        y.backward(_mine(grad, n, 1, sp))
        norm = grads.get_grad_norm([*column.parameters(), *row.parameters()], tp_group=groups[n])
        results[n] = {"output": y.detach(), "input grad": x_local.grad, "column weight grad": column.weight.grad,
                      "column bias grad": column.bias.grad, "row weight grad": row.weight.grad,
                      "row bias grad": row.bias.grad, "grad norm": norm}
    whole, shards = results[1], {}
    for n, got in results.items():  # each against this rank's part of TP 1's
        expected = {"output": _mine(whole["output"], n, 1, sp), "input grad": _mine(whole["input grad"], n, 1, sp),
                    "column weight grad": _mine(whole["column weight grad"], n, 2),
                    "column bias grad": _mine(whole["column bias grad"], n, 2),
                    "row weight grad": _mine(whole["row weight grad"].t(), n, 1).t(),
                    "row bias grad": whole["row bias grad"], "grad norm": whole["grad norm"]}
        shards[n] = sorted(name for name in got if not torch.equal(got[name], expected[name]))
    reference = {}
    if rank == 0:  # TP 1 against the unsharded computation (to rounding)
        x_ref = x.clone().requires_grad_()
        params = [p.clone().requires_grad_() for p in (w1, b1, w2, b2)]
        with autocast:
            y_ref = F.linear(_swiglu(F.linear(x_ref, params[0], params[1])), params[2], params[3])
        y_ref.backward(grad)
        pairs = {"output": (whole["output"], y_ref), "input grad": (whole["input grad"], x_ref.grad),
                 "column weight grad": (whole["column weight grad"], params[0].grad),
                 "row weight grad": (whole["row weight grad"], params[2].grad)}
        reference = {name: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                     for name, (a, b) in pairs.items()}
    return shards, reference


@pytest.mark.parametrize("sp, dtype", [(False, "fp32"), (True, "fp32"), (True, "bf16")])
def test_layers_over_24_blocks_are_bit_identical_at_tp_1_2_3_4_and_6(sp, dtype):
    results = run_on_ranks(_layers_body, 6, sp, dtype)
    assert [shards for shards, _ in results] == [{n: [] for n in SIZES if n == 1 or n > rank} for rank in range(6)]
    tolerance = 2e-2 if dtype == "bf16" else 1e-5
    assert all(error < tolerance for error in results[0][1].values()), results[0][1]


def _refused_body():
    group = dist.new_group([0, 1, 2])
    with pytest.raises(ValueError) as refused:
        invariant.RowLinear(48, 16, input_is_parallel=True, tp_group=group, device="cpu")
    return str(refused.value)


def test_layers_refuse_a_tp_size_that_does_not_divide_their_blocks():
    assert run_on_ranks(_refused_body, 3) == ["tp_invariant: the tensor-parallel size 3 must divide the 8 fixed "
                                              "blocks"] * 3
