"""``torch.compile`` of a tensor-parallel GPT: one graph (no breaks), the eager losses and grads.

``fullgraph=True`` turns any graph break into an error; the counting backend checks that one
graph was compiled and that later steps reuse it. The backward of every autograd function is
traced together with its forward, so a collective dynamo cannot trace in backward breaks the
forward graph too. Compiled as ``aot_eager`` is (AOT autograd's forward and backward graphs,
run eagerly) after inductor's post-grad passes: the graphs inductor's scheduler would get,
without a C++ build per test on 2 cores. Two tests build inductor's kernels: ``tensorpar train
--compile``'s, and a GPT's under a ledger (where the order of the kernels and the ledger's records
matters).
"""

import unittest.mock
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch._inductor.fx_passes.post_grad import post_grad_passes
from torch._inductor.virtualized import V

import tensorpar as tp
from tensorpar.distributed import comm
from tensorpar.tensor_parallel import keep_masks, linear_function, mappings
from tensorpar.models import GPT, GPTConfig
from tests.harness import run_on_ranks
from tests.test_gpt import _data, _full_grads, _single_rank_group

BASE = dict(vocab_size=101, max_seq_len=16, num_layers=2, num_heads=4, hidden_size=32,
            make_vocab_size_divisible_by=8)
RTOL, ATOL = 1e-5, 1e-6
# bf16 against TP=1, whose partial sums round to bf16 at other places: the loss to 1e-3, each grad
# to 2^-6 (twice bf16's precision) of its largest element (measured: 7e-5 and 0.8% of it).
BF16_LOSS_RTOL, BF16_GRAD_SCALE = 1e-3, 2.0 ** -6
STEPS = 2
GEMMS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


# The collectives launched in the graphs: torch's functional ones (inductor's post-grad passes make
# all_reduce in place).
_OP_NAMES = {"_c10d_functional.all_reduce": "all_reduce", "_c10d_functional.all_reduce_": "all_reduce",
             "_c10d_functional.all_gather_into_tensor": "all_gather",
             "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
             "_c10d_functional.all_to_all_single": "all_to_all"}


def _launched_collective(node) -> str | None:
    return _OP_NAMES.get(str(node.target).removesuffix(".default")) if node.op == "call_function" else None


def _is_view(node) -> bool:
    return getattr(node.target, "is_view", False) or node.target is torch.ops.aten._unsafe_view.default


def _counting_backend():
    """``aot_eager`` that keeps the dynamo graphs and the collectives in the AOT graphs it runs;
    ``overlapped`` ends with one ``"waits"`` entry per wait beyond one per collective.

    The AOT graphs run after inductor's post-grad passes (its pattern rewrites, such as folding
    ``mm + add`` into ``addmm``): the order of GEMMs and collectives its scheduler starts from.
    """
    graphs, collectives, overlapped = [], [], []

    def run_eagerly(gm, example_inputs):
        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            post_grad_passes(gm, is_inference=False)
        nodes = list(gm.graph.nodes)
        launched = [op for n in nodes if (op := _launched_collective(n))]
        overlapped.extend(["waits"] * (sum("wait_tensor" in str(n.target) for n in nodes) - len(launched)))
        for i, node in enumerate(nodes):  # collectives with a GEMM between their launch and wait
            waits = [nodes.index(u) for u in node.users if "wait_tensor" in str(u.target)]
            if waits and any(str(n.target) in GEMMS for n in nodes[i:min(waits)]):
                overlapped.append(str(node.target))
        collectives.extend(launched)
        return make_boxed_func(gm)

    # Inductor's partitioner, which decides what backward recomputes.
    aot = aot_autograd(fw_compiler=run_eagerly, bw_compiler=run_eagerly,
                       partition_fn=min_cut_rematerialization_partition)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)

    return backend, graphs, collectives, overlapped


def _column_layers(model):
    return sum(isinstance(m, tp.ColumnParallelLinear) for m in model.modules())


def _build(overrides, group):
    """One layer (each layer traces alike; tracing is what these tests spend their time on)."""
    tp.model_parallel_manual_seed(7, tp_group=group)
    return GPT(GPTConfig(**{**BASE, "num_layers": 1, **overrides}), tp_group=group)


def _unpadded_full_grads(model):
    """Every parameter's full gradient, the vocabulary's padding rows (as many as TP asks) cut off."""
    rows = {name: p.unpadded_rows for name, p in model.named_parameters() if hasattr(p, "unpadded_rows")}
    return {name: grad[:rows.get(name)] for name, grad in _full_grads(model).items()}


def _steps(model, forward, tokens, labels, *, bf16=False):
    """Losses, grads and collectives of STEPS SGD steps, the forward under bf16 autocast with
    ``bf16``. A model with gradient accumulation fusion gets its fp32 ``main_grad`` from a
    DataParallelGradReducer (of DP 1), as in training."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reducer = (tp.DataParallelGradReducer(model.parameters(), dp_group=_single_rank_group())
               if model.config.gradient_accumulation_fusion else None)
    losses, grads, ops = [], [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        if reducer is not None:
            reducer.zero_grad()
        with tp.CommLedger() as ledger:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = forward(tokens, labels)
            loss.backward()
        if reducer is not None:
            reducer.finish()  # .grad is main_grad now
        tp.allreduce_sequence_parallel_grads(model, tp_group=model.tp_group)
        losses.append(loss.detach())
        grads.append({**{name: p.grad.clone() for name, p in model.named_parameters()},
                      **{f"full {name}": grad for name, grad in _unpadded_full_grads(model).items()}})
        ops.append(sorted((r.op, r.shape, r.reduce_op) for r in ledger.records))
        optimizer.step()
    return losses, grads, ops


def _assert_matches_tp1(got, overrides, tokens, labels, *, bf16):
    """``got`` (the losses and grads of :func:`_steps`) are the unsharded model's: to rounding in
    fp32, to bf16's precision under bf16 autocast."""
    reference = _build({**overrides, "sequence_parallel": False, "recompute": False}, _single_rank_group())
    unsharded = _steps(reference, reference, tokens, labels, bf16=bf16)
    for s in range(STEPS):
        torch.testing.assert_close(got[0][s], unsharded[0][s], rtol=BF16_LOSS_RTOL if bf16 else RTOL,
                                   atol=0 if bf16 else ATOL, msg=lambda m: f"{overrides} step {s} loss vs TP=1: {m}")
        for name, grad in unsharded[1][s].items():
            if name.startswith("full "):
                tolerance = (dict(rtol=0, atol=BF16_GRAD_SCALE * grad.abs().max().item()) if bf16
                             else dict(rtol=RTOL, atol=ATOL))
                torch.testing.assert_close(got[1][s][name], grad, **tolerance,
                                           msg=lambda m, name=name: f"{overrides} step {s} {name} vs TP=1: {m}")


def _assert_same_losses_and_grads(got, expected, overrides):
    """``got`` and ``expected`` (of :func:`_steps`) have the same losses and grads, to rounding."""
    for s in range(STEPS):
        torch.testing.assert_close(got[0][s], expected[0][s], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{overrides} step {s} loss: {m}")
        for name, grad in expected[1][s].items():
            torch.testing.assert_close(got[1][s][name], grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name: f"{overrides} step {s} grad {name}: {m}")


def _compiled_matches_eager_body(cases, tp1):
    torch._dynamo.reset()
    group = _single_rank_group() if tp1 else None
    if not tp1:
        tp.initialize_model_parallel(dist.get_world_size())
    tokens, labels = _data()
    for case in cases:
        overrides = {k: v for k, v in case.items() if k != "bf16"}
        bf16 = case.get("bf16", False)
        eager = _build(overrides, group)
        compiled = _build(overrides, group)
        backend, graphs, collectives, overlapped = _counting_backend()
        step = torch.compile(compiled, backend=backend, fullgraph=True)
        # Compiled first: its trace meets the fused wgrad's one-time kernel probe, as train --compile's does.
        linear_function._FUSED_ADDMM_SUPPORTED.clear()
        got = _steps(compiled, step, tokens, labels, bf16=bf16)
        expected = _steps(eager, eager, tokens, labels, bf16=bf16)
        assert len(graphs) == 1, (overrides, len(graphs))  # and no recompile on the second step
        _assert_same_losses_and_grads(got, expected, overrides)
        for s in range(STEPS):
            # The ledger sees every collective of the compiled graphs, forward and backward, each step.
            ledger, graph = Counter(op for op, _, _ in got[2][s]), Counter(collectives)
            regathers = Counter(all_gather=_column_layers(compiled))
            if overrides.get("sequence_parallel"):
                # Except the backward re-gathers of the column inputs: the compiler merges each with
                # its forward twin (it keeps the gathered input), the ledger still counts it.
                assert ledger - graph == regathers, (overrides, ledger, graph)
            else:
                assert ledger == graph, (overrides, s, ledger, graph)
            if not overrides.get("recompute"):
                assert got[2][s] == expected[2][s], (overrides, s, got[2][s], expected[2][s])
        assert tp1 or expected[2][0], overrides
        if not tp1:
            _assert_matches_tp1(got, overrides, tokens, labels, bf16=bf16)
        if not tp1 and not overrides:
            # Each column layer's dgrad all-reduce is in flight while its wgrad GEMM computes, and
            # waited once: a second wait (funcol's own, right at the launch) is where inductor waited.
            assert "waits" not in overlapped, overlapped
            assert len(overlapped) >= _column_layers(compiled), overlapped
    return True


@pytest.mark.parametrize("world_size,cases", [
    (2, [{}, {"sequence_parallel": True}, {"recompute": True}]),
    (4, [{"sequence_parallel": True, "recompute": True}]),
    (2, [{"overlap": 2, "interleave": 2}]),
])
@pytest.mark.slow
def test_compiled_gpt_has_no_graph_break_and_matches_eager(world_size, cases):
    assert all(run_on_ranks(_compiled_matches_eager_body, world_size, cases, False, timeout=900))


@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", [
    (2, {"bf16": True, "gradient_accumulation_fusion": True}),
    # 6 query heads on 2 K/V heads, FFN 100: TP 3 splits neither evenly, K/V head 0 is on ranks 0 and 1.
    (3, {"num_heads": 6, "num_query_groups": 2, "hidden_size": 48, "ffn_hidden_size": 100}),
], ids=["bf16-grad-fusion", "replicated-kv-heads"])
def test_compiled_gpt_with_grad_fusion_under_bf16_or_replicated_kv_heads(world_size, case):
    """Issue 25, item 5: the fused wgrad's one-time kernel probe and the replicated K/V heads'
    gradient sum compile into the one graph, with the eager and the unsharded losses and grads."""
    assert all(run_on_ranks(_compiled_matches_eager_body, world_size, [case], False, timeout=900))


def test_compiled_gpt_at_tp1_has_no_graph_break_and_matches_eager():
    cases = [{"recompute": True, "position_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu"}]
    assert all(run_on_ranks(_compiled_matches_eager_body, 2, cases, True, timeout=900))


def _mappings_body():
    tp.initialize_model_parallel(dist.get_world_size())
    rank = dist.get_rank()
    x = torch.arange(24.0).reshape(2, 3, 4) + 100 * rank

    def regions(x):
        return (tp.gather_from_tensor_model_parallel_region(x),
                mappings.reduce_scatter_last_dim_to_tensor_parallel_region(x),
                tp.gather_from_sequence_parallel_region(x),
                tp.reduce_scatter_to_sequence_parallel_region(x),
                mappings.all_to_all(None, x))

    compiled = torch.compile(regions, backend="aot_eager", fullgraph=True)(x)
    for got, expected in zip(compiled, regions(x)):
        assert torch.equal(got, expected)
    return True


def test_compiled_mappings_match_eager():
    assert all(run_on_ranks(_mappings_body, 2, timeout=900))


def _inductor_under_a_ledger_body():
    torch._dynamo.reset()
    tp.initialize_model_parallel(2)
    tokens, labels = _data()
    eager, compiled = _build({}, None), _build({}, None)
    got = _steps(compiled, torch.compile(compiled), tokens, labels)
    expected = _steps(eager, eager, tokens, labels)
    _assert_same_losses_and_grads(got, expected, "inductor")
    assert got[2] == expected[2]
    return True


@pytest.mark.slow
def test_inductor_compiled_gpt_under_a_ledger_matches_eager():
    """Inductor's own kernels, as ``tensorpar train --compile`` builds them, with a CommLedger
    recording in the graphs: its records used to sit between a fused kernel and the inputs that
    kernel read, which inductor freed first (the backward read a deleted input); the eager losses,
    grads and records."""
    assert all(run_on_ranks(_inductor_under_a_ledger_body, 2, timeout=900))


def _train_body(argv):
    from tensorpar.cli.training_cli import parse_train_args
    from tensorpar.training.loop import train

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    linear_function._FUSED_ADDMM_SUPPORTED.clear()  # as in a fresh process: the compiled step probes
    losses = train(parse_train_args(argv)).losses
    return losses, dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.slow
def test_train_compile_gives_the_eager_losses(tmp_path):
    """``tensorpar train --compile`` (inductor) at TP=2 under SP, bf16 with gradient-accumulation
    fusion (issue 25, item 5: its wgrad op compiled): no graph break, the eager run's losses."""
    argv = ["--layers", "1", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--steps", "3", "--warmup", "1",
            "--lr", "1e-2", "--eval-every", "0", "--no-progress", "--seed", "7", "--tp", "2", "--sp",
            "--micro-batch", "2", "--dtype", "bf16", "--grad-fusion"]
    eager, _ = run_on_ranks(_train_body, 2, argv + ["--out", str(tmp_path / "eager")], timeout=900)[0]
    compiled, graph_breaks = run_on_ranks(_train_body, 2, argv + ["--out", str(tmp_path / "compiled"), "--compile"],
                                          timeout=900)[0]
    assert not graph_breaks
    assert sorted(compiled) == sorted(eager) == [1, 2, 3]
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step


def _compiled_masks(group, sequence_parallel):
    """Keep masks of compiled hidden dropout and compiled head-sharded dropout, from seed 3."""
    rank, n = comm.group_rank(group), comm.group_size(group)
    heads, rows = 4 // n, 8 // n if sequence_parallel else 8  # of 4 heads, 8 rows in all

    def masks(hidden, probs):
        hidden = tp.random.dropout(hidden, 0.5, sequence_parallel=sequence_parallel, tp_group=group)
        probs = tp.random.sharded_dropout(probs, 0.5, dim=1, start=rank * heads, full_size=4)
        return hidden != 0, probs != 0

    torch.manual_seed(3)
    return torch.compile(masks, backend="aot_eager", fullgraph=True)(torch.ones(rows, 3, 8), torch.ones(3, heads, 5, 5))


def _gathered(t, dim):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts, torch.cat(parts, dim)


def test_two_compiled_dropouts_of_one_tensor_draw_two_masks():
    """Compiled masks are drawn through an op the compiler does not know as random: merging two
    draws alike (common-subexpression elimination) would give both one mask."""
    def twice(x):
        return tp.random.dropout(x, 0.5), tp.random.dropout(x, 0.5)

    torch.manual_seed(0)
    first, second = torch.compile(twice, backend="aot_eager", fullgraph=True)(torch.ones(64, 8, requires_grad=True))
    assert not torch.equal(first != 0, second != 0)


def _dropout_body(cases):
    torch._dynamo.reset()
    tp.initialize_model_parallel(dist.get_world_size())
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    for sp in (False, True):
        hidden, heads = _compiled_masks(group, sp)
        full_hidden, full_heads = _compiled_masks(single, False)
        hidden_parts, hidden_cat = _gathered(hidden, 0)
        head_parts, heads_cat = _gathered(heads, 1)
        # Outside the TP region every rank keeps the TP=1 mask (under SP: its rows of it) ...
        assert torch.equal(hidden_cat, full_hidden) if sp else all(torch.equal(h, full_hidden) for h in hidden_parts)
        # ... inside it the ranks' heads get different masks, together the TP=1 mask.
        assert not torch.equal(head_parts[0], head_parts[1]) and torch.equal(heads_cat, full_heads), sp
        assert 0 < int(hidden.sum()) < hidden.numel()
    # Eager, the heads' masks come from each rank's own stream: different too.
    tp.model_parallel_manual_seed(5)
    eager_heads = tp.random.sharded_dropout(torch.ones(3, 2, 5, 5), 0.5, dim=1, start=2 * dist.get_rank(), full_size=4)
    eager_parts, _ = _gathered(eager_heads != 0, 1)
    assert not torch.equal(eager_parts[0], eager_parts[1])
    tokens, labels = _data()
    first = None  # the first case's TP=1 losses
    for k, overrides in enumerate(cases):
        losses = {}
        runs = (("tp1", single, 0.3), ("tp", None, 0.3), ("no dropout", None, 0.0))
        for name, tp_group, p in runs[:None if k == 0 else 2]:  # dropout changes the loss: seen once
            torch._dynamo.reset()  # each model's own graphs, none reused from the previous one
            model = _build({"dropout": p, **overrides}, tp_group)
            backend, graphs, *_ = _counting_backend()
            torch.manual_seed(11)  # the default stream, which compiled dropout draws from
            losses[name] = _steps(model, torch.compile(model, backend=backend, fullgraph=True), tokens, labels)[0]
            assert len(graphs) == 1, (overrides, name, len(graphs))
        # Compiled, the masks do not depend on TP (or SP, or recompute): the TP=1 losses, step after
        # step, and the first case's (a recompute that drew its masks anew would change the grads).
        if first is None:
            first = losses["tp1"]
        for name in ("tp", "tp1"):
            torch.testing.assert_close(losses[name], first, rtol=RTOL, atol=ATOL, msg=lambda m: f"{overrides}: {m}")
        assert k > 0 or losses["tp"][0] != losses["no dropout"][0], overrides
    _assert_saved_masks_are_this_ranks_only(tokens, labels)
    return True


def _assert_saved_masks_are_this_ranks_only(tokens, labels):
    """A compiled TP=2 GPT with SP saves for backward masks of its own heads and rows: a view of
    the whole mask would keep all of it alive (twice the memory at TP 2)."""
    torch._dynamo.reset()
    model = _build({"dropout": 0.3, "sequence_parallel": True}, None)
    masks = []

    def keep(tensor):
        if tensor.dtype == torch.bool:
            masks.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        torch.compile(model, backend="aot_eager", fullgraph=True)(tokens, labels)
    (b, s), heads = tokens.shape, BASE["num_heads"] // 2
    dropout_shapes = {(b, heads, s, s), (s // 2, b, BASE["hidden_size"])}  # attention's, and the hidden rows'
    saved = [mask for mask in masks if tuple(mask.shape) in dropout_shapes]
    assert {tuple(mask.shape) for mask in saved} == dropout_shapes
    assert all(mask.untyped_storage().nbytes() == mask.numel() * mask.element_size() for mask in saved)


def _drawn_mask_elements(overrides, group, tokens, labels) -> int:
    """The mask elements one compiled forward of a GPT draws on this rank."""
    torch._dynamo.reset()
    model, drawn, draw = _build(overrides, group), [], keep_masks._draw_keep

    def counted(out, keep_prob, generator):
        drawn.append(out.numel())
        return draw(out, keep_prob, generator)

    with unittest.mock.patch.object(keep_masks, "_draw_keep", counted):
        torch.compile(model, backend="aot_eager", fullgraph=True)(tokens, labels)
    return sum(drawn)


def _own_masks_body():
    tp.initialize_model_parallel(2)
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    tokens, labels = _data()
    attention = {"dropout": 0.0, "attention_dropout": 0.3}
    hidden = {"dropout": 0.3, "attention_dropout": 0.0, "sequence_parallel": True}
    drawn = {"attention": [_drawn_mask_elements(attention, g, tokens, labels) for g in (single, group)]}
    a_row = tokens.shape[0] * BASE["hidden_size"]  # batch x hidden: each row of [s, b, h] a block of its own
    with unittest.mock.patch.object(keep_masks, "DROPOUT_BLOCK_ELEMENTS", a_row):
        drawn["hidden rows"] = [_drawn_mask_elements(hidden, g, tokens, labels) for g in (single, group)]
    return drawn


@pytest.mark.slow
def test_compiled_ranks_draw_only_their_own_masks():
    """Compiled on CPU, a TP=2 rank draws the masks of its own heads, and under SP of its own rows'
    blocks: half of TP=1's draws (as eager), not TP=1's whole masks to keep half of."""
    for drawn in run_on_ranks(_own_masks_body, 2):
        for site, (tp1, tp2) in drawn.items():
            assert tp1 > 0 and 2 * tp2 == tp1, (site, tp1, tp2)


@pytest.mark.slow
def test_compiled_dropout_has_no_graph_break_and_keeps_the_tp_masks():
    """Hidden and attention dropout > 0 at TP=2, and with SP and recompute: one graph; replicated masks
    equal on every rank, the heads' masks different per rank, and the losses of TP=1."""
    cases = [{}, {"sequence_parallel": True, "recompute": True}]
    assert all(run_on_ranks(_dropout_body, 2, cases, timeout=900))
