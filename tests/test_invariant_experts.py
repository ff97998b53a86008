"""The invariant mode with experts (``tensorpar.invariant.MoELayer``): the same bits as one rank
at every TP, SP, CP and EP size, layer by layer and for a training run (``--tp-invariant``)."""

import json
import os
import unittest.mock

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar import parallel_state
from tensorpar.distributed.tree_reduce import HalvingTree, SourceTrees
from tensorpar.invariant import MoELayer
from tests.harness import run_on_ranks
from tests.test_training_experts import MOE, _train_body

BLOCKS = 8


def test_source_trees_are_the_halving_tree_of_the_sources_parts_in_order():
    parts = [torch.randn(32, generator=torch.Generator().manual_seed(i)) * 10.0 ** (i % 5) for i in range(16)]
    whole = HalvingTree(leaves=16)
    want = [whole.add(p.clone()) for p in parts][-1]
    for sources in (1, 2, 4):
        leaves = 16 // sources
        trees = SourceTrees(sources=sources, leaves=leaves)
        got = [trees.add([parts[s * leaves + i].clone() for s in range(sources)]) for i in range(leaves)]
        assert all(g is None for g in got[:-1]) and torch.equal(got[-1], want)
    with pytest.raises(ValueError, match="3 sources are not a power of two"):
        SourceTrees(sources=3, leaves=4)


def _moe(score_function: str, **groups) -> MoELayer:
    torch.manual_seed(3)
    moe = MoELayer(16, blocks=BLOCKS, num_experts=8, ffn_hidden_size=8, topk=2, score_function=score_function,
                   aux_loss_coeff=0.1, z_loss_coeff=0.01, enable_expert_bias=True, **groups)
    moe.router.expert_bias[0] = -10.0  # expert 0 receives no token: its rank computes nothing
    return moe


def _this_ranks(t: torch.Tensor, *, cp_size, cp_rank, tp_size, tp_rank, sequence_parallel) -> torch.Tensor:
    """This rank's rows of a ``[s, b, h]`` micro-batch: its CP chunks, then its SP slice."""
    if cp_size > 1:
        chunks = t.chunk(2 * cp_size)
        t = torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])
    return t.chunk(tp_size)[tp_rank] if sequence_parallel else t


def _layout_body(tp_size: int, cp_size: int, ep_size: int, sequence_parallel: bool, score_function: str):
    tp.initialize_model_parallel(tp_size, context_parallel_size=cp_size, expert_model_parallel_size=ep_size,
                                 expert_tensor_parallel_size=1)
    cp_group = parallel_state.get_context_parallel_group() if cp_size > 1 else None
    exchange = parallel_state.get_tensor_and_context_parallel_group()
    moe = _moe(score_function, tp_group=tp.get_tensor_model_parallel_group(), cp_group=cp_group,
               ep_group=parallel_state.get_expert_model_parallel_group(), sequence_parallel=sequence_parallel,
               exchange_group=exchange)
    where = dict(cp_size=cp_size, cp_rank=parallel_state.get_context_parallel_rank(), tp_size=tp_size,
                 tp_rank=tp.get_tensor_model_parallel_rank(), sequence_parallel=sequence_parallel)
    dp_rank, dp_size = tp.get_data_parallel_rank(), tp.get_data_parallel_world_size()
    inputs = []
    for d in range(dp_size):
        torch.manual_seed(100 + d)
        inputs.append((torch.randn(2 * BLOCKS, 2, 16), torch.randn(2 * BLOCKS, 2, 16)))
    x = _this_ranks(inputs[dp_rank][0], **where).clone().requires_grad_()
    out = moe(x)
    (out * _this_ranks(inputs[dp_rank][1], **where)).sum().backward()

    reference, wanted = _moe(score_function), []   # one rank, one micro-batch a backward
    for x_d, g_d in inputs:
        x_d = x_d.clone().requires_grad_()
        reference.zero_grad()
        out_d = reference(x_d)
        (out_d * g_d).sum().backward()
        wanted.append((out_d, x_d.grad, *(p.grad.clone() for p in (reference.router.weight, reference.experts.gate_up,
                                                                    reference.experts.down))))
    want_out, want_x_grad, want_router = wanted[dp_rank][:3]
    assert torch.equal(out, _this_ranks(want_out, **where))
    assert torch.equal(x.grad, _this_ranks(want_x_grad, **where))
    assert torch.equal(moe.router.weight.grad, want_router)  # summed over the TP and CP ranks' tokens
    held = slice(moe.experts.first_expert, moe.experts.first_expert + moe.experts.num_local_experts)
    for k, param in enumerate((moe.experts.gate_up, moe.experts.down)):
        sources = [param.grad, *(param.other_source_grads or [])]
        assert len(sources) == moe.sources == max(1, ep_size // (tp_size * cp_size))
        if moe.sources > 1 or ep_size >= tp_size * cp_size:  # one micro-batch of each data rank of the EP group
            for s, grad in enumerate(sources):
                assert torch.equal(grad, wanted[dp_rank - moe.slot + s][3 + k][held]), (k, s)
        else:  # the experts' replicas over TP x CP computed a share each, -0.0 for the others
            every = [torch.empty_like(param.grad) for _ in range(tp_size * cp_size)]
            dist.all_gather(every, param.grad, group=exchange)
            position = dist.get_rank(exchange)
            replicas = [every[r] for r in range(position % ep_size, tp_size * cp_size, ep_size)]
            for share, grad in enumerate(replicas):
                others = torch.ones(len(grad), dtype=torch.bool)
                others[share * moe.computed:(share + 1) * moe.computed] = False
                assert ((grad[others] == 0) & grad[others].signbit()).all()
            assert torch.equal(sum(replicas[1:], replicas[0]), wanted[dp_rank][3 + k][held]), k


@pytest.mark.parametrize("tp_size,cp_size,ep_size,sequence_parallel,score", [
    (1, 1, 2, False, "softmax"), (1, 1, 4, False, "sigmoid"), (2, 1, 1, False, "softmax"),
    (2, 1, 2, True, "sigmoid"), (2, 1, 4, True, "softmax"), (1, 2, 2, False, "softmax"),
    (2, 2, 1, True, "sigmoid"), (2, 2, 4, True, "softmax")],
    ids=["ep2", "ep4-sigmoid", "tp2-ep1", "tp2-sp-ep2-sigmoid", "tp2-sp-ep4", "cp2-ep2", "tp2-cp2-sp-ep1-sigmoid",
         "tp2-cp2-sp-ep4"])
def test_the_layer_gives_one_ranks_bits_at_every_layout(tp_size, cp_size, ep_size, sequence_parallel, score):
    """Output, input grad, the router's weight grad (whole on every rank) and each expert's grad
    of each data rank's micro-batch equal one rank's bit for bit."""
    run_on_ranks(_layout_body, 4, tp_size, cp_size, ep_size, sequence_parallel, score)


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [2, 8])
def test_the_layer_gives_one_ranks_bits_at_tp2_x_cp2_x_dp2(ep_size):
    """8 ranks: EP 2 below TP x CP (the TP x CP group splits the computing), EP 8 over two data
    ranks' TP x CP groups."""
    run_on_ranks(_layout_body, 8, 2, 2, ep_size, True, "softmax")


def _refused_body():
    tp.initialize_model_parallel(2, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    with pytest.raises(ValueError, match="at EP 1 below TP x CP = 2 the layer needs exchange_group="):
        _moe("softmax", tp_group=tp.get_tensor_model_parallel_group(),
             ep_group=parallel_state.get_expert_model_parallel_group())


def test_the_layer_refuses_ep_below_tp_without_the_exchange_group():
    run_on_ranks(_refused_body, 2)


# 3 validation micro-batches: the DP ranks' shares differ, and each runs as many forwards (EP spans them).
INVARIANT = MOE + ["--tp-invariant", "--steps", "3", "--eval-every", "3", "--eval-iters", "3"]


def _train_on_threads_body(argv, threads):
    with unittest.mock.patch.dict(os.environ, {"OMP_NUM_THREADS": str(threads)}):
        result = _train_body(argv)
    torch.set_num_threads(1)
    return result


@pytest.fixture(scope="module")
def invariant_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariant-ep")
    cases = {"ep1": (1, 1, ["--tp", "1"]), "ep2": (4, 1, ["--tp", "1", "--ep", "2"]),
             "ep4": (4, 1, ["--tp", "1", "--ep", "4"]), "tp2-ep1": (4, 1, ["--tp", "2"]),
             "tp2-sp-ep2": (4, 1, ["--tp", "2", "--sp", "--ep", "2"]),
             "cp2-ep2": (4, 1, ["--tp", "1", "--cp", "2", "--cp-comm", "a2a", "--ep", "2"]),
             "pp2-ep2": (4, 1, ["--tp", "1", "--pp", "2", "--ep", "2"]),
             "fsdp-ep2": (4, 1, ["--tp", "1", "--fsdp", "--ep", "2"]),
             "hsdp-ep4": (4, 1, ["--tp", "1", "--fsdp", "--dp-replicate", "2", "--ep", "4"]),
             "ep1 on 2 threads": (1, 2, ["--tp", "1"]), "ep4 on 2 threads": (4, 2, ["--tp", "1", "--ep", "4"]),
             "ep1 compiled": (1, 1, ["--tp", "1", "--compile"]),
             "tp2-sp-ep2 compiled": (2, 1, ["--tp", "2", "--sp", "--ep", "2", "--compile"])}
    for name, (world, threads, flags) in cases.items():
        run_on_ranks(_train_on_threads_body, world, INVARIANT + flags + ["--out", str(root / name)], threads)
    return root


def _rows(root, name):
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name,baseline", [
    (name, "ep1") for name in ("ep2", "ep4", "tp2-ep1", "tp2-sp-ep2", "cp2-ep2", "pp2-ep2", "fsdp-ep2", "hsdp-ep4")]
    + [("ep4 on 2 threads", "ep1 on 2 threads"), ("tp2-sp-ep2 compiled", "ep1 compiled")])
def test_training_with_experts_is_bit_identical_at_every_layout(invariant_runs, name, baseline):
    """Every step's loss, grad norm and load, and the validation loss, equal EP 1's bit for bit
    (the logged aux loss adds the ranks' shares of it: equal to rounding)."""
    got, want = _rows(invariant_runs, name), _rows(invariant_runs, baseline)
    assert len(got) == len(want) == 4
    for row, expected in zip(got, want):
        for field in ("loss", "grad_norm", "moe_imbalance", "val_loss"):
            assert row.get(field) == expected.get(field), (field, row, expected)
        if "loss" in row:
            assert row["moe_aux_loss"] == pytest.approx(expected["moe_aux_loss"], rel=1e-6)
