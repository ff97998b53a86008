"""The TP-invariant mode over a block count that TP sizes other than powers of two divide
(issue 30): ``ColumnLinear``/``RowLinear`` with ``blocks=24``, and a GPT with
``invariant_blocks=24``, give the same bits at TP 1, 2, 3, 4 and 6, where TP 3's and TP 6's
ranks hold blocks that are not one subtree of the blocks' tree and exchange each subtree's
partial sum (``tree_reduce.subtree_sums``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensorpar import invariant
from tensorpar.invariant.lanewise import lanewise
from tensorpar.models import GPTConfig, context_split
from tensorpar.distributed.tree_reduce import HalvingTree, subtree_sums, subtrees, tree_sum
from tests.harness import run_on_ranks
from tests.test_invariant import _reports

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
    return lanewise(F.silu, gate) * up  # as the invariant GPT's MLP


def _layers_body(sp: bool, dtype: str):
    """Column (stride 2) -> SwiGLU -> Row over 24 blocks at each TP size (Llama's MLP): every rank's
    output, input grad and weight/bias grads, and the invariant grad norm; plus TP 1's errors
    against F.linear. 72 features: at every TP size (72 to 12 per rank) a row is no whole number
    of SIMD steps, so without ``lanewise`` its last columns would take the scalar tail loop."""
    from tensorpar.data_parallel import grads

    rank, results = dist.get_rank(), {}
    groups = {n: dist.new_group(list(range(n))) for n in SIZES[1:]}
    groups[1] = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # TP 1 on every rank
    torch.manual_seed(0)
    x = torch.randn(24, 2, 48)
    w1, b1 = torch.randn(2 * 72, 48) / 7, torch.randn(2 * 72)
    w2, b2 = torch.randn(48, 72) / 14, torch.randn(48)
    grad = torch.randn(24, 2, 48)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    for n in SIZES:
        if rank >= n > 1:
            continue
        column = invariant.ColumnLinear(48, 2 * 72, stride=2, blocks=24, sequence_parallel=sp and n > 1,
                                        tp_group=groups[n], device="cpu")
        row = invariant.RowLinear(72, 48, blocks=24, input_is_parallel=True, sequence_parallel=sp and n > 1,
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


def _shared_rows_body(sp: bool):
    """ColumnLinear with 96 query rows split over TP and 2 x 48 K|V rows whole on every rank
    (shared_rows, as grouped-query attention's QKV layer), over 24 blocks at each TP size: the
    output's query part and the whole K/V part, the input grad, the weight and bias grads and the
    grad norm; plus TP 1's errors against F.linear."""
    from tensorpar.data_parallel import grads

    rank, results = dist.get_rank(), {}
    groups = {n: dist.new_group(list(range(n))) for n in SIZES[1:]}
    groups[1] = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    torch.manual_seed(0)
    x, w, b = torch.randn(24, 2, 48), torch.randn(192, 48) / 7, torch.randn(192)
    grad = torch.randn(24, 2, 192)

    def mine(t, n, dim=0):  # this rank's query rows, then every K/V row (outputs: dim -1)
        q, kv = t.movedim(dim, 0).split([96, 96])
        return torch.cat([_mine(q, n, 1), kv]).movedim(0, dim)

    for n in SIZES:
        if rank >= n > 1:
            continue
        rows = [[(r * 96 // n, (r + 1) * 96 // n), (96, 192)] for r in range(n)]
        layer = invariant.ColumnLinear(48, 192, blocks=24, shared_rows=96, shared_stride=2, partition_rows=rows,
                                       sequence_parallel=sp and n > 1, tp_group=groups[n], device="cpu")
        with torch.no_grad():
            layer.weight.copy_(mine(w, n))
            layer.bias.copy_(mine(b, n))
        x_local = _mine(x, n, 1, sp).clone().requires_grad_()
        y, _ = layer(x_local)
        y.backward(mine(grad, n, -1))
        results[n] = {"output": y.detach(), "input grad": x_local.grad, "weight grad": layer.weight.grad,
                      "bias grad": layer.bias.grad,
                      "grad norm": grads.get_grad_norm(list(layer.parameters()), tp_group=groups[n])}
    whole = results[1]
    shards = {n: sorted(name for name, value in got.items() if not torch.equal(value, {
        "output": mine(whole["output"], n, -1), "input grad": _mine(whole["input grad"], n, 1, sp),
        "weight grad": mine(whole["weight grad"], n), "bias grad": mine(whole["bias grad"], n),
        "grad norm": whole["grad norm"]}[name])) for n, got in results.items()}
    x_ref, w_ref, b_ref = (t.clone().requires_grad_() for t in (x, w, b))
    F.linear(x_ref, w_ref, b_ref).backward(grad)
    pairs = {"output": (whole["output"], F.linear(x, w, b)), "input grad": (whole["input grad"], x_ref.grad),
             "weight grad": (whole["weight grad"], w_ref.grad), "bias grad": (whole["bias grad"], b_ref.grad)}
    return shards, {name: ((a - e).abs().max() / e.abs().max()).item() for name, (a, e) in pairs.items()}


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_shared_rows_are_whole_on_every_rank_and_bit_identical_at_tp_1_2_3_4_and_6(sp):
    results = run_on_ranks(_shared_rows_body, 6, sp)
    assert [shards for shards, _ in results] == [{n: [] for n in SIZES if n == 1 or n > rank} for rank in range(6)]
    assert all(error < 1e-5 for error in results[0][1].values()), results[0][1]


def _refused_body():
    group = dist.new_group([0, 1, 2])
    with pytest.raises(ValueError) as refused:
        invariant.RowLinear(48, 16, input_is_parallel=True, tp_group=group, device="cpu")
    return str(refused.value)


def test_layers_refuse_a_tp_size_that_does_not_divide_their_blocks():
    assert run_on_ranks(_refused_body, 3) == ["tp_invariant: the tensor-parallel size 3 must divide the 8 fixed "
                                              "blocks"] * 3


# 6 heads of 16 and every TP-split width a multiple of 24 blocks; the FFN's 216 no whole number
# of SIMD steps on any rank (216 to 36), so the MLP's activation needs ``lanewise`` at every TP
# size; hidden and attention dropout on.
GPT2_6_HEADS = GPTConfig(vocab_size=96, max_seq_len=24, num_layers=2, num_heads=6, hidden_size=96, ffn_hidden_size=216,
                         dropout=0.1, attention_dropout=0.2, tp_invariant=True, invariant_blocks=24)
# Grouped-query: 6 heads of 24, 2 K/V heads (the query heads 0-2 and 3-5): at TP 3 rank 1's two
# query heads read both, at TP 6 each K/V head's 3 query heads are on 3 ranks.
LLAMA_6_HEADS = dataclasses.replace(GPT2_6_HEADS, hidden_size=144, num_query_groups=2, norm="rmsnorm",
                                    activation="swiglu", position_embedding="rope", bias=False,
                                    tie_word_embeddings=False)


def _gpt_body(config, layouts):
    reports = _reports(config, layouts)
    return reports and reports[0]  # rank 0: each layout's mismatch with TP 1's run, or None


@pytest.mark.slow
@pytest.mark.parametrize("config, layouts", [
    (GPT2_6_HEADS, [(1, False, False), (2, False, False), (2, True, False), (3, False, False), (3, True, True),
                    (6, False, False), (6, True, False)]),
    (LLAMA_6_HEADS, [(1, False, False), (2, True, False), (3, False, False), (3, True, True), (6, False, False),
                     (6, False, True)])],
    ids=["gpt2", "llama-gqa"])
def test_gpt_over_24_blocks_trains_the_same_bits_at_tp_1_2_3_and_6(config, layouts):
    """(TP, SP, recompute) layouts against TP 1: losses == after 3 AdamW steps with dropout, and
    every weight torch.equal. The Llama-style model's 2 K/V heads: on every rank, each K/V head's
    grads summed over query heads that sit on 1, 2 or 3 ranks."""
    report = run_on_ranks(_gpt_body, 6, config, layouts, timeout=300)[0]
    assert report == {layout: None for layout in layouts[1:]}


@pytest.mark.slow
def test_train_over_24_blocks_at_tp3_x_dp2_resumed_at_tp1_x_dp2_trains_the_tp1_run(tmp_path):
    """``tensorpar train --tp-invariant --invariant-blocks 24`` (Llama-style, 3 K/V heads, bf16,
    recompute): TP 3 x DP 2 saved at step 2 and resumed at TP 1 x DP 2 gives TP 1 x DP 1's
    losses (==) and final weights (torch.equal)."""
    from tests.test_invariant import TRAIN, _train_body, _weights_body

    argv = [*TRAIN[:TRAIN.index("--grad-accum")], "--global-batch", "4", *TRAIN[TRAIN.index("--grad-accum") + 2:],
            "--hidden", "144", "--ffn-hidden", "216", "--heads", "6", "--kv-heads", "2", "--norm", "rmsnorm",
            "--activation", "swiglu", "--position-embedding", "rope", "--dtype", "bf16", "--recompute", "--invariant-blocks", "24",
            "--steps", "4", "--seq-len", "24"]

    def train(tp_size, ranks, out, *extra):
        return run_on_ranks(_train_body, ranks, argv + ["--tp", str(tp_size), "--out", str(tmp_path / out), *extra],
                            timeout=300)[0]

    whole, whole_ckpt = train(1, 1, "tp1")
    saved, _ = train(3, 6, "tp3xdp2", "--save-every", "2")
    resumed, resumed_ckpt = train(1, 2, "tp1xdp2", "--resume", str(tmp_path / "tp3xdp2" / "step_2"))
    assert list(whole) == [1, 2, 3, 4] and saved == whole and resumed == {3: whole[3], 4: whole[4]}
    reference, weights = (run_on_ranks(_weights_body, 1, str(c))[0] for c in (whole_ckpt, resumed_ckpt))
    assert [name for name in weights if not torch.equal(weights[name], reference[name])] == []


def test_what_24_blocks_cannot_keep_bit_identical_is_refused_naming_it():
    invariant.check_gpt_sizes(dataclasses.replace(GPT2_6_HEADS, sequence_parallel=True), tp_size=6, seq_len=48)
    with pytest.raises(ValueError, match="the sequence length 16 not divisible by the 24 fixed sequence blocks"):
        invariant.check_gpt_sizes(GPT2_6_HEADS, tp_size=3, seq_len=16)
    ulysses = dataclasses.replace(GPT2_6_HEADS, context_parallel_comm="a2a", attention_dropout=0.0)
    assert context_split.invariant_refusals(ulysses, tp_size=1, cp_size=3, sequence_parallel=False) == [
        "CP size 3 (the 24 fixed sequence blocks make 2 x CP whole chunks at CP 1, 2 and 4 only)"]  # 8 blocks a rank
    invariant.check_gpt_sizes(LLAMA_6_HEADS, tp_size=3, seq_len=24)
    with pytest.raises(ValueError, match="num_query_groups x head_dim 32 not divisible by the 24 fixed blocks"):
        invariant.check_gpt_sizes(dataclasses.replace(LLAMA_6_HEADS, hidden_size=96), tp_size=3)
    with pytest.raises(ValueError, match="num_heads 6 at the tensor-parallel size 4: tp_invariant needs the query "
                                         "heads divisible by TP"):
        invariant.check_gpt_sizes(LLAMA_6_HEADS, tp_size=4)
    assert GPT2_6_HEADS.padded_vocab_size(1) == GPT2_6_HEADS.padded_vocab_size(3) == 384  # lcm(128, 24)


def test_train_at_tp3_names_the_blocks_it_needs(capsys):
    from tensorpar.cli.main import main

    assert main(["train", "--nproc", "3", "--tp", "3", "--tp-invariant", "--layers", "1", "--hidden", "96",
                 "--heads", "6", "--seq-len", "24", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--tp-invariant: the tensor-parallel size 3 does not divide the 8 fixed blocks (they serve TP 1, 2, 4, " \
           "8; invariant_blocks (--invariant-blocks) 24 serves 1, 2, 3, 4, 6, 8)" in err and "Traceback" not in err


@pytest.mark.slow
def test_tp3_with_cp_pp_and_fsdp_trains_the_tp1_run(tmp_path):
    """GPT-2-style, 6 heads reading 2 K/V heads, 24 blocks, hidden dropout, 2 micro-batches a
    step: TP 3 + SP x CP 2 (a2a), TP 3 x PP 2 and TP 3 x DP 2 with FSDP, and that FSDP run resumed
    at TP 1 x DP 2 with FSDP after step 1, against TP 1: losses == and final weights torch.equal."""
    from tests.test_invariant import _train_body, _weights_body

    argv = ["--tp-invariant", "--invariant-blocks", "24", "--layers", "2", "--hidden", "144", "--heads", "6",
            "--kv-heads", "2",
            "--seq-len", "24", "--steps", "2", "--micro-batch", "2", "--global-batch", "4", "--dropout", "0.1",
            "--attention-dropout", "0", "--eval-every", "0", "--no-progress", "--seed", "5"]
    layouts = {"tp1": (1, []), "tp3xcp2-sp": (6, ["--cp", "2", "--cp-comm", "a2a", "--sp"]), "tp3xpp2": (6, ["--pp", "2"]),
               "tp3xdp2-fsdp": (6, ["--fsdp", "--fsdp-min-unit-mib", "0", "--save-every", "1"]),
               # FSDP's shards of the QKV layer loaded into another layout (its K/V rows whole on each TP
               # rank), in other units (the default's: the blocks in the root).
               "tp1xdp2-fsdp-resumed": (2, ["--fsdp", "--resume", str(tmp_path / "tp3xdp2-fsdp" / "step_1")])}
    runs = {name: run_on_ranks(_train_body, ranks, argv + ["--tp", "3" if name.startswith("tp3") else "1", *flags,
                                                           "--out", str(tmp_path / name)], timeout=300)[0]
            for name, (ranks, flags) in layouts.items()}
    resumed = runs.pop("tp1xdp2-fsdp-resumed")
    assert {name: losses for name, (losses, _) in runs.items()} == {name: runs["tp1"][0] for name in runs}
    assert resumed[0] == {2: runs["tp1"][0][2]}
    runs["tp1xdp2-fsdp-resumed"] = resumed
    reference = run_on_ranks(_weights_body, 1, str(runs["tp1"][1]))[0]
    for name, (_, ckpt) in runs.items():
        weights = run_on_ranks(_weights_body, 1, str(ckpt))[0]
        assert [key for key in weights if not torch.equal(weights[key], reference[key])] == [], name
