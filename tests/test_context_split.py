"""A GPT over a context-parallel group (tensorpar.models.context_split): at CP 2 and 4, in both
modes, the loss and every weight gradient (summed over CP) equal the CP=1 model's, for a
GPT-2-style and a Llama-style GQA model, with a sequence 2 x CP does not divide, with heads TP
or CP does not divide, and with hidden and attention dropout (each token's and each (head, query,
key)'s mask that of its global position)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar import CommLedger
from tensorpar.distributed import comm
from tensorpar.models import GPT, GPTConfig
from tests.harness import run_on_ranks

GPT2 = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=2, num_heads=4, hidden_size=32)
LLAMA = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=2, num_heads=4, num_query_groups=2, hidden_size=32,
                  norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                  tie_word_embeddings=False)
# Heads TP does not divide: at TP 2 a rank holds query heads 0-2 reading K/V heads 0, 0, 1, the other 3-5
# reading 1, 2, 2 (K/V head 1 replicated over TP); CP then splits each rank's 3 heads 2 + 1.
UNEVEN = dataclasses.replace(LLAMA, num_heads=6, num_query_groups=3, hidden_size=48)
MODELS = {"gpt2": GPT2, "llama": LLAMA, "uneven": UNEVEN, "6x2": dataclasses.replace(UNEVEN, num_query_groups=2)}
SEQ_LEN = 13                         # 2 x CP divides it at no CP size: every run pads

_GROUPS: dict = {}


def _groups():
    """(this rank's group of one rank, the whole world as the CP group), made once."""
    if not _GROUPS:
        # Every rank creates every group, in one order.
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _GROUPS["one"], _GROUPS["cp"] = singles[dist.get_rank()], dist.new_group(list(range(dist.get_world_size())))
    return _GROUPS["one"], _GROUPS["cp"]


def _step(config: GPTConfig, tp_group, cp_group=None):
    tp.model_parallel_manual_seed(1234, tp_group=tp_group)
    model = GPT(config, tp_group=tp_group, cp_group=cp_group, device="cpu")
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (2, SEQ_LEN + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[0, 3] = -100                                     # an ignored label on some rank's chunk
    with CommLedger() as ledger:
        loss = model(tokens[:, :-1], labels)
        loss.backward()
    partial = {name for name, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, ledger, partial


def _gpt_body(name: str, mode: str, recompute: bool, dropout: float = 0.0):
    one, cp_group = _groups()
    config = dataclasses.replace(MODELS[name], context_parallel_comm=mode, recompute=recompute, dropout=dropout,
                                 attention_dropout=dropout)
    reference_loss, reference_grads, _, _ = _step(dataclasses.replace(config, recompute=False), one)
    loss, grads, ledger, _ = _step(config, one, cp_group)
    torch.testing.assert_close(loss, reference_loss)
    for param, grad in grads.items():
        torch.testing.assert_close(comm.all_reduce(grad, cp_group), reference_grads[param], msg=param)
    return ledger.ops()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["a2a", "p2p"])
@pytest.mark.parametrize("cp", [2, 4])
def test_gpt_at_cp_equals_cp_1_loss_and_every_gradient(name, mode, cp):
    ops = run_on_ranks(_gpt_body, cp, name, mode, False)[0]
    attention_op = "all_to_all" if mode == "a2a" else "send_recv"
    per_layer = {"a2a": 4, "p2p": (cp - 1) + (2 * cp - 1)}[mode]     # forward + backward per attention
    assert ops.count(attention_op) == per_layer * GPT2.num_layers
    assert ops.count("all_reduce") == 2                            # the loss's sum and token count


def test_gpt_with_6_heads_and_2_kv_heads_at_cp_4_a2a_equals_cp_1():
    # Query heads 2, 2, 1, 1 per CP rank: K/V head 0 read on ranks 0-1, head 1 on ranks 1-3.
    run_on_ranks(_gpt_body, 4, "6x2", "a2a", False)


@pytest.mark.parametrize("mode", ["a2a", "p2p"])
def test_gpt_at_cp_with_recompute_and_dropout_equals_cp_1(mode):
    # The recomputed blocks draw the forward's masks again (hidden and attention dropout).
    run_on_ranks(_gpt_body, 2, "llama", mode, True, 0.1)


@pytest.mark.parametrize("mode", ["a2a", "p2p"])
def test_gpt_at_cp_with_dropout_equals_cp_1(mode):
    run_on_ranks(_gpt_body, 2, "gpt2", mode, False, 0.1)


def _tp_cp_groups(tp_size: int = 2):
    """TP x CP over the world in Megatron's order (TP fastest): this rank's TP and CP groups."""
    if ("tp", tp_size) not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        # Every rank creates every group, in one order.
        tp_groups = [dist.new_group(list(range(r, r + tp_size))) for r in range(0, world, tp_size)]
        cp_groups = [dist.new_group(list(range(t, world, tp_size))) for t in range(tp_size)]
        _GROUPS["tp", tp_size] = tp_groups[rank // tp_size], cp_groups[rank % tp_size]
    return _GROUPS["tp", tp_size]


def _tp_cp_body(name: str, mode: str, sequence_parallel: bool, dropout: float = 0.0, tp_size: int = 2):
    tp_group, cp_group = _tp_cp_groups(tp_size)
    config = dataclasses.replace(MODELS[name], context_parallel_comm=mode, sequence_parallel=sequence_parallel,
                                 dropout=dropout, attention_dropout=dropout)
    reference_loss, reference_grads, _, _ = _step(config, tp_group)
    loss, grads, _, partial = _step(config, tp_group, cp_group)
    torch.testing.assert_close(loss, reference_loss)
    for param, grad in grads.items():
        grad, reference = comm.all_reduce(grad, cp_group), reference_grads[param]
        if param in partial:
            # Partial over each TP rank's tokens, which differ with CP: compared summed over TP.
            grad, reference = comm.all_reduce(grad, tp_group), comm.all_reduce(reference.clone(), tp_group)
        torch.testing.assert_close(grad, reference, msg=param)
    return True


@pytest.mark.parametrize("name,sequence_parallel", [("gpt2", True), ("llama", True), ("llama", False)])
@pytest.mark.parametrize("mode", ["a2a", "p2p"])
def test_gpt_at_tp_2_cp_2_equals_tp_2_cp_1(name, mode, sequence_parallel):
    assert all(run_on_ranks(_tp_cp_body, 4, name, mode, sequence_parallel))


@pytest.mark.parametrize("name,mode", [("uneven", "a2a"), ("uneven", "p2p"), ("6x2", "a2a")])
def test_gpt_at_tp_2_cp_2_with_heads_split_unevenly_equals_tp_2_cp_1(name, mode):
    """Heads (and K/V heads) TP or CP does not divide, replicated K/V heads: TP 2 x CP 2 equals TP 2."""
    assert all(run_on_ranks(_tp_cp_body, 4, name, mode, True))


@pytest.mark.slow
def test_llama_with_4_heads_and_2_kv_heads_at_tp_4_cp_2_equals_tp_4_cp_1():
    # One query head per TP rank, each K/V head replicated on two TP ranks; 8 ranks, p2p (a2a: one head < CP 2).
    assert all(run_on_ranks(_tp_cp_body, 8, "llama", "p2p", True, 0.0, 4))


@pytest.mark.parametrize("name,mode", [("llama", "p2p"), ("uneven", "a2a")])
def test_gpt_at_tp_2_cp_2_with_sp_and_dropout_equals_tp_2_cp_1(name, mode):
    """Hidden and attention dropout: each (head, query, key) the mask TP 2 x CP 1 draws there."""
    assert all(run_on_ranks(_tp_cp_body, 4, name, mode, True, 0.1))


def _refusal_body():
    _, cp_group = _groups()
    try:
        GPT(dataclasses.replace(GPT2, interleave=2), tp_group=_groups()[0], cp_group=cp_group, device="cpu")
    except ValueError as error:
        return str(error)
    return None


def test_gpt_at_cp_refuses_what_it_cannot_do_in_one_line():
    message = run_on_ranks(_refusal_body, 2)[0]
    assert message == "context parallelism does not support interleave=2 yet"
    with pytest.raises(ValueError, match="context_parallel_comm must be one of"):
        dataclasses.replace(GPT2, context_parallel_comm="ring")
