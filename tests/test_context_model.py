"""The context-parallel communication model (tensorpar.planning.context) against hand values and
against CommLedger measurements of a CP x TP GPT step (a2a and p2p, SP, recompute, uneven heads,
padding, bf16), and ``tensorpar comm --cp`` with what it refuses."""

import functools
import traceback

import pytest
import torch

import tensorpar as tp
from tensorpar.planning import context as context_model
from tensorpar.planning.communication import CommConfig, LinkModel
from tensorpar.planning.context import ContextConfig, attention_comm, buckets, parameter_numels, ring_overlap
from tensorpar.data_parallel.grads import DataParallelGradReducer
from tensorpar.cli import main as cli
from tensorpar.cli.comm_measure import gpt_config, measure_on_this_rank, record_key
from tests.harness import run_on_ranks

# 13 tokens: 2 x CP (x TP under SP) divides it at no size, so every case pads.
TINY = dict(layer="gpt-step", hidden=32, heads=4, kv_heads=2, seq_len=13, batch=2, vocab=64, layers=2, dtype="fp32")


def test_ring_sends_kv_forward_and_kv_then_their_fp32_grads_backward():
    comm = attention_comm(heads=4, kv_heads=2, head_dim=8, batch=2, local_len=8, cp=4, cp_rank=1, comm_type="p2p",
                          dtype=torch.bfloat16)
    assert [(op.op, op.shape, op.dtype) for op in comm.forward] == [("send_recv", (2, 2, 2, 8, 8), torch.bfloat16)] * 3
    kv, grad = ("send_recv", (2, 2, 2, 8, 8), torch.bfloat16), ("send_recv", (2, 2, 2, 1, 8, 8), torch.float32)
    assert [(op.op, op.shape, op.dtype) for op in comm.backward] == [kv, grad] * 3 + [grad]
    assert {op.group_size for op in comm.forward + comm.backward} == {4}
    assert comm.forward[0].bytes_sent_per_rank == comm.forward[0].bytes  # one whole send per ring step


def test_ulysses_all_to_alls_carry_each_ranks_uneven_head_split():
    # 6 heads, 2 K/V heads over CP 4: ranks get query heads 0-1, 2-3, 4, 5 and, for each, K and V of
    # the K/V heads they read: 0; 0 and 1 (head 2 reads 0, head 3 reads 1); 1; 1.
    per_destination = [2 + 2 * 1, 2 + 2 * 2, 1 + 2 * 1, 1 + 2 * 1]
    for rank, (heads, received) in enumerate(zip([2, 2, 1, 1], per_destination)):
        comm = attention_comm(heads=6, kv_heads=2, head_dim=8, batch=1, local_len=4, cp=4, cp_rank=rank,
                              comm_type="a2a", dtype=torch.float32)
        # Q|K|V out (every destination's share), the output back (from each rank), their reverses.
        assert [op.shape[0] for op in comm.forward + comm.backward] == [16, 4 * heads, 6, 4 * received]


def test_the_ring_hides_what_the_attention_of_the_block_in_hand_outlasts():
    cfg = CommConfig(**{**TINY, "tp": 1, "seq_len": 16})
    kv_bytes = 2 * 2 * 2 * 8 * 8 * 4                   # [2, b, G, 2L, d] fp32, per ring step
    pair = 2 * 2 * 4 * 4 * 4 * 8                        # b heads L^2 d x 2 FLOPs per matmul, L = 4
    # Compute far outlasts the link: everything but the last dK/dV pass of backward is hidden.
    link = LinkModel(latency_s=0.0, bytes_per_s=kv_bytes, flops_per_s=pair, overlap=1.0)
    forward, backward = ring_overlap(cfg, ContextConfig(cp=2), link)
    assert (forward["communication_s"], forward["compute_s"], forward["exposed_s"]) == (1.0, 2 * (3 + 2), 0.0)
    assert (backward["communication_s"], backward["compute_s"], backward["exposed_s"]) == (3.0, 5 * (3 + 2), 1.0)
    # Without overlap every byte waits.
    forward, backward = ring_overlap(cfg, ContextConfig(cp=2), LinkModel(0.0, kv_bytes, pair, overlap=0.0))
    assert (forward["exposed_s"], backward["exposed_s"]) == (1.0, 3.0)


def _buckets_body():
    tp.initialize_model_parallel(1)
    config = gpt_config(CommConfig(**{**TINY, "tp": 1}))
    params = list(tp.GPT(config).parameters())
    assert parameter_numels(config, tp=1) == [p.numel() for p in params]
    for bucket_bytes in (1, 4 * 2000, 25 * 2**20):
        reducer = DataParallelGradReducer(params, dp_group=tp.get_data_parallel_group(), bucket_bytes=bucket_bytes)
        assert buckets([p.numel() for p in params], bucket_bytes=bucket_bytes) == [
            b.buffer.numel() for b in reducer.buckets], bucket_bytes
        reducer.remove_hooks()
    return len(params)


def test_grad_buckets_are_the_reducers():
    assert run_on_ranks(_buckets_body, 1) == [2 * 12 + 4]  # 12 per block; positions, word, final norm


# --- measured: every rank's CommLedger equals its CP rank's prediction, in order ------------------

def _cases(world_size):
    if world_size == 2:
        return [(dict(tp=1), ContextConfig(cp=2, comm_type=mode)) for mode in ("a2a", "p2p")] + [
            (dict(tp=1, recompute=True, dtype="bf16"), ContextConfig(cp=2, comm_type="p2p"))]
    return [(dict(tp=2, sp=sp, recompute=sp), ContextConfig(cp=2, comm_type=mode))
            for mode in ("a2a", "p2p") for sp in (False, True)] + [
        (dict(tp=1, heads=6, hidden=48), ContextConfig(cp=4, comm_type="a2a")),  # 2, 2, 1, 1 heads; K/V replicated
        (dict(tp=1), ContextConfig(cp=2, comm_type="p2p", dp=2))]


def _body(cases):
    results = []
    for overrides, context in cases:
        cfg = CommConfig(**{**TINY, **overrides})
        tp.initialize_model_parallel(cfg.tp, context_parallel_size=context.cp)
        try:
            results.append(measure_on_this_rank(cfg, context=context))
        except Exception:  # one case's failure is that case's, not the batch's
            results.append(traceback.format_exc())
        finally:
            tp.destroy_model_parallel()
    return results


@functools.lru_cache(maxsize=None)
def _measured(world_size):
    return run_on_ranks(_body, world_size, _cases(world_size))


@pytest.mark.parametrize("world_size, case", [(2, i) for i in range(len(_cases(2)))]
                         + [pytest.param(4, i, marks=pytest.mark.slow) for i in range(len(_cases(4)))])
def test_model_equals_commledger_record_on_every_rank(world_size, case):
    overrides, context = _cases(world_size)[case]
    cfg = CommConfig(**{**TINY, **overrides})
    for rank, results in enumerate(_measured(world_size)):
        got = results[case]
        assert not isinstance(got, str), got
        predicted = context_model.step_collectives(cfg, gpt_config(cfg), context, cp_rank=rank // cfg.tp % context.cp)
        assert got == [record_key(op) for op in predicted], rank
        assert sum(k[-1] == context.cp for k in got) >= 2  # the loss's, at least, over CP


def test_comm_cp_measure_on_the_command_line_agrees(capsys):
    argv = ["comm", "--layer", "gpt-step", "--tp", "1", "--layers", "1", "--hidden", "16", "--heads", "2",
            "--seq-len", "8", "--vocab", "32", "--dtype", "fp32", "--cp", "2", "--cp-comm", "p2p", "--measure"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "predicted compute/communication overlap: " in out
    # Per rank: forward a K/V send and the loss's 2 all-reduces, backward a K/V send and 2 of their
    # grads, then the DP x CP reduction.
    assert out.splitlines()[-1] == "measured 14 collectives on 2 ranks, predicted 14: all agree"


@pytest.mark.parametrize("argv, message", [
    (["--cp-comm", "a2a"], "--cp-comm applies with --cp"),
    (["--cp", "1"], "--cp 1 splits nothing"),
    (["--cp", "2", "--fsdp"], "--cp 2 with --fsdp is not supported yet"),
    (["--cp", "2", "--pp", "2"], "--pp 2 with --cp is not supported yet"),
    (["--cp", "2", "--layer", "mlp"], "--cp models a GPT step's attention: use --layer gpt-step, not mlp"),
    (["--cp", "4", "--cp-comm", "a2a", "--heads", "4"], "at least one query head per CP rank: 2 heads at CP 4"),
    (["--cp", "2", "--heads", "6", "--hidden", "48", "--tp", "4"], "needs the TP size (4) to divide heads (6)"),
])
def test_comm_cp_refuses_in_one_line(argv, message, capsys):
    base = ["comm", "--layer", "gpt-step", "--hidden", "64", "--heads", "4", "--seq-len", "16", "--layers", "2"]
    assert cli.main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
