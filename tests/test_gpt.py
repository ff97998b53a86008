"""GPT at TP = 2 and 4 against the TP=1 model built from the same seed, in the same process."""

import contextlib
import unittest.mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.tensor_parallel import keep_masks
from tensorpar.context_parallel import attention_dropout
from tensorpar.models import GPT, GPTConfig, gather_full_tensor
from tests.harness import run_on_ranks

BASE = dict(vocab_size=101, max_seq_len=16, num_layers=2, num_heads=4, hidden_size=32,
            make_vocab_size_divisible_by=8)
LLAMA = dict(norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
             tie_word_embeddings=False)
# Grouped-query attention (2 query heads per K/V head), Qwen2's QKV biases, Llama 3's rope scaling.
GQA = dict(LLAMA, num_heads=8, num_query_groups=4, qkv_bias=True, rope_theta=5e5,
           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 4})
VOCAB_NEVER = 100  # an eos id the test never expects to see first
# fp32, different summation orders across ranks: relative error ~1e-6 of the largest value.
RTOL, ATOL = 1e-5, 1e-6

_SINGLE_RANK_GROUP = []


def _single_rank_group():
    """A TP group of this rank alone, for the TP=1 reference (every rank creates all of them)."""
    if not _SINGLE_RANK_GROUP:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _SINGLE_RANK_GROUP.append(groups[dist.get_rank()])
    return _SINGLE_RANK_GROUP[0]


def _everyone(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _build(config, group, seed=7):
    tp.model_parallel_manual_seed(seed, tp_group=group)
    return GPT(config, tp_group=group)


def _full_grads(model):
    return {lay.name: gather_full_tensor(lay.param.grad, partition_dim=lay.partition_dim,
                                         stride=lay.partition_stride, tp_group=model.tp_group,
                                         partition_rows=lay.partition_rows)
            if lay.tensor_model_parallel else lay.param.grad.clone()
            for lay in model.parameter_layouts()}


def _assert_trains_as_tp1(model, reference, tokens, labels, seed=11):
    """One forward and backward of ``model`` and of its TP=1 ``reference``, each from ``seed``: the
    same loss and full gradients. Returns ``model``'s loss."""
    losses = []
    for m in (reference, model):
        tp.model_parallel_manual_seed(seed, tp_group=m.tp_group)
        loss = m(tokens, labels)
        loss.backward()
        tp.allreduce_sequence_parallel_grads(m, tp_group=m.tp_group)
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=RTOL, atol=ATOL)
    ref_grads, tp_grads = _full_grads(reference), _full_grads(model)
    for name in ref_grads:
        torch.testing.assert_close(tp_grads[name], ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)
    return losses[1]


def _data(seed=1, batch=2, seq=8):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, BASE["vocab_size"], (batch, seq), generator=g)
    labels = torch.randint(0, BASE["vocab_size"], (batch, seq), generator=g)
    labels[0, :3] = -100
    return tokens, labels


def _equivalence_body(cases):
    tp.initialize_model_parallel(dist.get_world_size())
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    tokens, labels = _data()
    for overrides in cases:
        config = GPTConfig(**{**BASE, **overrides})
        reference_config = GPTConfig(**{**BASE, **overrides, "sequence_parallel": False, "recompute": False,
                                        "distribute_saved_activations": False})
        models = {"ref": _build(reference_config, single), "tp": _build(config, group)}
        ref_full, tp_full = models["ref"].full_state_dict(), models["tp"].full_state_dict()
        assert ref_full.keys() == tp_full.keys()
        for name in ref_full:  # TP-invariant initialisation
            torch.testing.assert_close(tp_full[name], ref_full[name], rtol=0, atol=0, msg=name)
        # SGD, not Adam: Adam's first step moves a parameter by ~lr * sign(grad), so a grad
        # that is 0 up to summation-order noise (~1e-8) would move by +-lr on either side.
        optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
        for step in range(3):
            losses, grads = {}, {}
            for key, model in models.items():
                optimizers[key].zero_grad()
                loss = model(tokens, labels)
                loss.backward()
                tp.allreduce_sequence_parallel_grads(model, tp_group=model.tp_group)
                losses[key], grads[key] = loss.detach(), _full_grads(model)
                optimizers[key].step()
            for other in _everyone(losses["tp"]):  # the same loss on every rank
                assert torch.equal(other, losses["tp"]), (overrides, step)
            torch.testing.assert_close(losses["tp"], losses["ref"], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{overrides} step {step}: {m}")
            for name, ref_grad in grads["ref"].items():
                torch.testing.assert_close(grads["tp"][name], ref_grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, name=name: f"{overrides} step {step}: grad of {name}: {m}")
            # Padded vocab rows are never looked up and get no probability: zero grads.
            for key in grads:
                assert not grads[key]["embedding.word.weight"][BASE["vocab_size"]:].any()
        # Padding does not change the loss: the unpadded logits give the same cross-entropy.
        with torch.no_grad():
            logits = models["ref"](tokens)
            assert logits.shape == (2, 8, 104)
            unpadded = F.cross_entropy(logits[..., :BASE["vocab_size"]].reshape(-1, BASE["vocab_size"]),
                                       labels.reshape(-1))
            torch.testing.assert_close(models["ref"](tokens, labels), unpadded, rtol=RTOL, atol=ATOL)
            local = models["tp"](tokens)
            assert local.shape == (2, 8, 104 // dist.get_world_size())
            gathered = torch.cat(_everyone(local), dim=-1)
            torch.testing.assert_close(gathered, logits, rtol=RTOL, atol=ATOL)
    return True


EQUIVALENCE_CASES = [
    {},
    {"sequence_parallel": True},
    {"recompute": True},
    {"recompute": True, "distribute_saved_activations": True},
    {"sequence_parallel": True, "recompute": True},
    LLAMA,
    {**LLAMA, "sequence_parallel": True, "recompute": True},
    {**GQA, "sequence_parallel": True},
    {"activation": "gelu_tanh", "tie_word_embeddings": False, "sequence_parallel": True},
    {"overlap": 3},
    {"sequence_parallel": True, "recompute": True, "overlap": 3},
    {"interleave": 2},
    {**LLAMA, "sequence_parallel": True, "interleave": 2, "overlap": 2},
]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.slow
def test_gpt_matches_tp1_loss_grads_and_optimizer_steps(world_size):
    assert run_on_ranks(_equivalence_body, world_size, EQUIVALENCE_CASES) == [True] * world_size


# Qwen3's attention: a head dimension (16) apart from hidden / heads (8), and per-head Q/K norms,
# whose weights every TP rank holds and whose grads it sums over TP.
QWEN3 = dict(LLAMA, num_heads=4, num_query_groups=2, kv_channels=16, qk_layernorm=True)


def test_qwen3_attention_matches_tp1_loss_grads_and_optimizer_steps():
    cases = [QWEN3, {**QWEN3, "sequence_parallel": True, "recompute": True}]
    assert run_on_ranks(_equivalence_body, 2, cases) == [True] * 2


# Qwen2's shape: 6 query heads over 2 (or 1, or 6) K/V heads, QKV biases, an FFN of 200, vocab 101.
QWEN2 = dict(BASE, **LLAMA, num_heads=6, hidden_size=48, ffn_hidden_size=200, qkv_bias=True, max_seq_len=16)
# "seq": sequences of 11 and 13 do not divide by TP, which SP pads (and masks).
UNEVEN_CASES = [{"num_query_groups": 2}, {"num_query_groups": 1, "sequence_parallel": True},
                {"num_query_groups": 2, "sequence_parallel": True, "overlap": 2, "seq": 11}, {"num_query_groups": 6},
                {"num_query_groups": 3, "activation": "gelu", "interleave": 2, "recompute": True},
                {"num_query_groups": 2, "sequence_parallel": True, "position_embedding": "learned", "seq": 13}]


def _uneven_body(cases):
    """Heads, K/V heads and FFN rows that TP does not divide: the TP=1 model's loss, logits,
    every gradient and three SGD steps; the same full weights from either model."""
    tp.initialize_model_parallel(dist.get_world_size())
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    for overrides in cases:
        overrides = dict(overrides)
        tokens, labels = _data(seq=overrides.pop("seq", 12))
        config = GPTConfig(**{**QWEN2, **overrides})
        models = {"ref": _build(GPTConfig(**{**QWEN2, **overrides, "sequence_parallel": False}), single),
                  "tp": _build(config, group)}
        ref_full, tp_full = models["ref"].full_state_dict(), models["tp"].full_state_dict()
        for name in ref_full:  # TP-invariant initialisation, also of uneven shards
            assert torch.equal(tp_full[name][:ref_full[name].shape[0]], ref_full[name]), (overrides, name)
        optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
        for step in range(3):
            losses, grads, norms = {}, {}, {}
            for key, model in models.items():
                optimizers[key].zero_grad()
                loss = model(tokens, labels)
                loss.backward()
                tp.allreduce_sequence_parallel_grads(model, tp_group=model.tp_group)
                losses[key], grads[key] = loss.detach(), _full_grads(model)
                norms[key] = tp.get_grad_norm(model.parameters(), tp_group=model.tp_group)
                optimizers[key].step()
            torch.testing.assert_close(losses["tp"], losses["ref"], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{overrides} step {step}: {m}")
            # Replicated K/V rows are counted once.
            torch.testing.assert_close(norms["tp"], norms["ref"], rtol=RTOL, atol=ATOL)
            for name, ref_grad in grads["ref"].items():
                rows = ref_grad.shape[0]  # the vocabulary's padding may differ between TP sizes
                torch.testing.assert_close(grads["tp"][name][:rows], ref_grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, name=name: f"{overrides} step {step}: grad of {name}: {m}")
        with torch.no_grad():
            vocab = BASE["vocab_size"]
            logits = torch.cat(_everyone(models["tp"](tokens)), dim=-1)[..., :vocab]
            torch.testing.assert_close(logits, models["ref"](tokens)[..., :vocab], rtol=RTOL, atol=ATOL)
            models["tp"].eval(), models["ref"].eval()
            out = models["tp"].generate(tokens[:, :5], 4, temperature=0)
            assert torch.equal(out, models["ref"].generate(tokens[:, :5], 4, temperature=0)), overrides
    return True


@pytest.mark.parametrize("world_size, cases", [(2, UNEVEN_CASES), (3, UNEVEN_CASES), (4, UNEVEN_CASES),
                                               (6, UNEVEN_CASES[:3])])   # TP 6: a head per rank
@pytest.mark.slow
def test_uneven_heads_kv_heads_and_ffn_match_tp1(world_size, cases):
    assert run_on_ranks(_uneven_body, world_size, cases) == [True] * world_size


@contextlib.contextmanager
def _attention_mask_probe(records):
    """Record the attention dropout masks the GPT draws (``keep_mask``: by global head and position)."""
    original = attention_dropout.keep_mask

    def probe(*args, **kwargs):
        records.append(original(*args, **kwargs))
        return records[-1]

    with unittest.mock.patch.object(attention_dropout, "keep_mask", probe):
        yield


def _dropout_body():
    tp.initialize_model_parallel(dist.get_world_size())
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    n, rank = dist.get_world_size(), dist.get_rank()
    tokens, labels = _data()

    # Residual/embedding dropout acts on replicated (or SP-split) activations: its masks are
    # drawn from the shared default stream, the same as TP=1 draws, so the model is TP=1's.
    for sp in (False, True):
        config = GPTConfig(**BASE, dropout=0.3, attention_dropout=0.0, sequence_parallel=sp)
        model = _build(config, group)
        loss = _assert_trains_as_tp1(model, _build(config, single), tokens, labels)
        with torch.no_grad():  # dropout really is on
            assert not torch.allclose(model.eval()(tokens, labels), loss)

    # Attention dropout acts on each rank's own heads: each global head's mask is its own.
    results = {}
    for recompute in (False, True):
        config = GPTConfig(**BASE, dropout=0.1, attention_dropout=0.5, recompute=recompute)
        model = _build(config, group)
        records = []
        tp.model_parallel_manual_seed(5, tp_group=group)
        with _attention_mask_probe(records):
            loss = model(tokens, labels)
            forward_masks = len(records)
            loss.backward()
        results[recompute] = (loss.detach(), _full_grads(model), records)
        assert forward_masks == 2
        if recompute:  # backward recomputes the blocks, last first, with the forward's masks
            assert len(records) == 4
            for first, again in zip(records[:2], reversed(records[2:])):
                assert torch.equal(first, again)
        mask = records[0]
        assert mask.shape == (2, 4 // n, 8, 8)
        causal = torch.ones(8, 8, dtype=torch.bool).tril()
        dropped = (~mask & causal).sum().item() / (causal.sum().item() * mask.shape[0] * mask.shape[1])
        assert 0.3 < dropped < 0.7, dropped
        masks = _everyone(mask)
        for other in range(n):
            if other != rank:
                assert not torch.equal(masks[other], mask)  # independent per TP rank
    plain, recomputed = results[False], results[True]
    assert torch.equal(plain[0], recomputed[0])
    for name in plain[1]:
        torch.testing.assert_close(recomputed[1][name], plain[1][name], rtol=0, atol=0, msg=name)
    for a, b in zip(plain[2], recomputed[2]):
        assert torch.equal(a, b)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_dropout_masks_and_recompute(world_size):
    assert run_on_ranks(_dropout_body, world_size) == [True] * world_size


def _size_dependent_draw(out, p, generator):
    """A draw whose value at a position depends on the size drawn, as CUDA's Philox kernel's does
    (below ~270k elements): element ``i`` of an ``n``-element draw is the generator's ``n + i``-th."""
    values = torch.rand(2 * out.numel(), generator=generator)[out.numel():]
    return out.copy_((values < p).view(out.shape))


def _padded_dropout_body():
    tp.initialize_model_parallel(dist.get_world_size())
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    tokens, labels = _data(seq=11)  # SP pads 11 tokens to 12 at TP 2 and 4
    config = GPTConfig(**BASE, dropout=0.3, attention_dropout=0.0, sequence_parallel=True)
    model, reference = _build(config, group), _build(config, single)
    # Blocks of 3 rows: the last real block (rows 9, 10) is cut by the padding at row 11.
    with unittest.mock.patch.object(keep_masks, "_draw_keep", _size_dependent_draw), \
            unittest.mock.patch.object(keep_masks, "DROPOUT_BLOCK_ELEMENTS", 3 * 2 * BASE["hidden_size"]):
        _assert_trains_as_tp1(model, reference, tokens, labels)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_dropout_of_a_padded_sequence_is_tp1s_whatever_the_draw_size(world_size):
    """Item 4 of issue 25: every block is drawn at its TP=1 extent, so a generator that maps values
    to positions by the size drawn gives the real tokens TP=1's masks (the padding is masked apart)."""
    assert run_on_ranks(_padded_dropout_body, world_size) == [True] * world_size


def _ledger_body(sequence_parallel):
    tp.initialize_model_parallel(dist.get_world_size())
    n = dist.get_world_size()
    config = GPTConfig(**{**BASE, "num_layers": 1}, sequence_parallel=sequence_parallel)
    tp.model_parallel_manual_seed(3)
    model = GPT(config)
    s, b, h = 8, 2, BASE["hidden_size"]
    x = torch.randn(s // n if sequence_parallel else s, b, h, requires_grad=True)
    with tp.CommLedger() as block_ledger:
        with block_ledger.phase("forward"):
            y = model.blocks[0](x)
        with block_ledger.phase("backward"):
            y.backward(torch.randn_like(y))
    tokens, labels = _data()
    with tp.CommLedger() as model_ledger:
        with model_ledger.phase("forward"):
            loss = model(tokens, labels)
        with model_ledger.phase("backward"):
            loss.backward()
    return [[(r.phase, r.op, r.shape) for r in ledger.records] for ledger in (block_ledger, model_ledger)]


def test_comm_ledger_of_one_layer_without_sp():
    block, model = run_on_ranks(_ledger_body, 2, False)[0]
    act = (8, 2, 32)
    assert block == [("forward", "all_reduce", act)] * 2 + [("backward", "all_reduce", act)] * 2
    # + embedding all-reduce ([b, s, h]), cross-entropy max and sum all-reduces forward;
    # + the LM head's input-grad all-reduce backward.
    assert model == ([("forward", "all_reduce", (2, 8, 32))] + [("forward", "all_reduce", act)] * 2
                     + [("forward", "all_reduce", (8, 2)), ("forward", "all_reduce", (2, 8, 2))]
                     + [("backward", "all_reduce", act)] * 3)


@pytest.mark.parametrize("world_size", [2, 4])
def test_comm_ledger_of_one_layer_with_sp(world_size):
    block, model = run_on_ranks(_ledger_body, world_size, True)[0]
    act = (8, 2, 32)
    ag, rs = ("all_gather", act), ("reduce_scatter", act)
    forward = [("forward",) + op for op in (ag, rs, ag, rs)]
    # Per layer pair, last first: grad of the row output gathered, the column input
    # re-gathered for its wgrad, the column input grad reduce-scattered.
    backward = [("backward",) + op for op in (ag, ag, rs, ag, ag, rs)]
    assert block == forward + backward
    assert model == ([("forward", "reduce_scatter", act)] + forward
                     + [("forward", "all_gather", act),
                        ("forward", "all_reduce", (8, 2)), ("forward", "all_reduce", (2, 8, 2))]
                     + [("backward",) + op for op in (ag, rs)] + backward + [("backward",) + ag])


def _generate_body():
    tp.initialize_model_parallel(dist.get_world_size())
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    prompt = _data(seq=5)[0]
    # A batch of a 5- and a 3-token prompt, the short one left-padded.
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    padded = prompt.masked_fill(mask == 0, 0)
    for overrides in ({}, {"sequence_parallel": True}, GQA, {**GQA, "sequence_parallel": True}):
        config = GPTConfig(**{**BASE, **overrides})
        ref, model = _build(config, single).eval(), _build(config, group).eval()
        greedy = model.generate(prompt, 14, temperature=0)  # runs past max_seq_len: the window slides
        assert greedy.shape == (2, 19)
        assert torch.equal(greedy, ref.generate(prompt, 14, temperature=0)), overrides
        assert torch.equal(greedy, model.generate(prompt, 14, temperature=0, use_cache=False)), overrides
        batch = model.generate(padded, 8, temperature=0, attention_mask=mask)
        assert torch.equal(batch, ref.generate(padded, 8, temperature=0, attention_mask=mask)), overrides
        assert torch.equal(batch, model.generate(padded, 8, temperature=0, attention_mask=mask, use_cache=False))
        for row, start in ((0, 0), (1, 2)):  # each prompt alone continues the same way
            alone = model.generate(padded[row:row + 1, start:], 8, temperature=0)[0]
            assert torch.equal(batch[row, start:], alone), (overrides, row)
        # After eos a sequence repeats it; generation stops once every sequence has it.
        eos = int(greedy[0, 5])
        stopped = model.generate(prompt, 14, temperature=0, eos_token_id=[eos, VOCAB_NEVER])
        ends = [5 + int((row[5:] == eos).nonzero()[0]) + 1 if (row[5:] == eos).any() else 19 for row in greedy]
        assert stopped.shape[1] == max(ends), overrides
        for row, end in enumerate(ends):
            assert torch.equal(stopped[row, :end], greedy[row, :end]) and (stopped[row, end:] == eos).all()
        torch.manual_seed(dist.get_rank())  # sampling must not depend on anything rank-local
        tp.model_parallel_manual_seed(4, tp_group=group)
        for top_k, top_p in ((10, None), (None, 0.9), (20, 0.5)):
            sampled = model.generate(prompt, 6, temperature=0.9, top_k=top_k, top_p=top_p)
            for other in _everyone(sampled):
                assert torch.equal(other, sampled)
            assert int(sampled.max()) < BASE["vocab_size"]
    return True


@pytest.mark.slow
def test_generate_is_identical_on_tp_ranks_and_matches_tp1():
    assert run_on_ranks(_generate_body, 2) == [True, True]


def _cached_steps_body():
    tp.initialize_model_parallel(dist.get_world_size())
    tokens = _data(seq=8)[0]
    for overrides, steps in (({}, (4, 1, 1, 2)), (GQA, (5, 1, 2)), ({"sequence_parallel": True}, (4, 2, 2))):
        model = _build(GPTConfig(**{**BASE, **overrides}), tp.get_tensor_model_parallel_group()).eval()
        with torch.no_grad():
            full = model(tokens)
            cache, start = model.new_kv_cache(tokens.shape[0], tokens.shape[1]), 0
            for n in steps:
                positions = torch.arange(start, start + n).expand(tokens.shape[0], n)
                step = model(tokens[:, start:start + n], position_ids=positions, kv_cache=cache)
                torch.testing.assert_close(step, full[:, start:start + n], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{overrides} positions {start}..{start + n - 1}: {m}")
                start += n
    return True


def test_forward_with_kv_cache_and_no_mask_attends_to_every_cached_position():
    """Issue 16 item 8: without ``attn_mask`` a step after cached keys sees all of them, not
    SDPA's top-left causal corner (a decode step used to see cache slot 0 only)."""
    assert run_on_ranks(_cached_steps_body, 2) == [True, True]


def _bad_input_body():
    tp.initialize_model_parallel(dist.get_world_size())
    with pytest.raises(ValueError, match=r"num_heads \(2\) is smaller than the tensor-parallel size \(4\)"):
        GPT(GPTConfig(**{**BASE, "num_heads": 2}))
    model = GPT(GPTConfig(**BASE, sequence_parallel=True))
    tokens = _data()[0]
    with pytest.raises(ValueError, match="sequence length 17 is longer than max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token id 101 is outside the vocabulary \[0, 101\)"):
        model(torch.full((1, 8), 101))
    with pytest.raises(ValueError, match=r"token id -1 is outside the vocabulary \[0, 101\)"):
        model(torch.full((1, 8), -1))
    # SP pads a sequence TP does not divide, except where a mask or cache pins its positions.
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by the tensor-parallel size 4, as "
                                         "sequence parallelism with an attention mask or a KV cache needs"):
        model(tokens[:, :6], attn_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"labels of shape \[2, 7\] must match tokens of shape \[2, 8\]"):
        model(tokens, tokens[:, :7])
    return True


def test_bad_input_is_a_clear_error():
    assert run_on_ranks(_bad_input_body, 4) == [True] * 4


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match=r"hidden_size \(30\) is not divisible by num_heads \(4\)"):
        GPTConfig(**{**BASE, "hidden_size": 30})
    with pytest.raises(ValueError, match="norm must be one of"):
        GPTConfig(**BASE, norm="batchnorm")
    with pytest.raises(ValueError, match="distribute_saved_activations needs"):
        GPTConfig(**BASE, recompute=True, sequence_parallel=True, distribute_saved_activations=True)
    with pytest.raises(ValueError, match="unknown GPTConfig preset"):
        GPTConfig.preset("huge")
    small = GPTConfig.preset("small")
    assert (small.num_layers, small.hidden_size, small.ffn_hidden_size) == (12, 768, 3072)
    # The padded vocabulary does not depend on TP when TP divides the multiple.
    assert {small.padded_vocab_size(t) for t in (1, 2, 4, 8)} == {50304}
    assert GPTConfig.preset("tiny", vocab_size=100, make_vocab_size_divisible_by=1).padded_vocab_size(3) == 102
    assert GPTConfig.preset("llama-tiny").activation == "swiglu"


def _tied_fused_head_body():
    """Items 2 and 10: the tied head allocates no weight, uses fp32 wgrad fusion, and the
    embedding weight's main_grad holds both uses' gradients (DP reducer, zero_out_wgrad)."""
    tp.initialize_model_parallel(dist.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    tokens, labels = _data()
    fused = _build(GPTConfig(**BASE, gradient_accumulation_fusion=True), group)
    plain = _build(GPTConfig(**BASE), group)
    assert fused.lm_head.weight is None and fused.lm_head.gradient_accumulation_fusion
    assert "lm_head.weight" not in fused.state_dict()
    reducer = tp.DataParallelGradReducer(fused.parameters(), dp_group=tp.get_data_parallel_group())
    reducer.zero_grad()
    fused(tokens, labels).backward()
    reducer.finish()
    plain(tokens, labels).backward()
    weight = fused.embedding.word.weight
    assert weight.zero_out_wgrad
    torch.testing.assert_close(weight.main_grad, plain.embedding.word.weight.grad, rtol=RTOL, atol=ATOL)
    reducer.remove_hooks()
    return True


def test_tied_head_allocates_no_weight_and_fuses_its_wgrad():
    assert run_on_ranks(_tied_fused_head_body, 2) == [True, True]


def _host_sync_body(config_overrides):
    """Item 8: a training micro-batch (forward, loss, backward) queues everything without
    waiting for the device (range checks asynchronous, as off CPU)."""
    import unittest.mock

    from tests.op_counter import OpCounter

    tp.initialize_model_parallel(dist.get_world_size())
    model = _build(GPTConfig(**{**BASE, **config_overrides}), tp.get_tensor_model_parallel_group())
    tokens, labels = _data()
    with unittest.mock.patch("tensorpar.errors._reads_back", lambda t: False), OpCounter() as ops:
        model(tokens, labels).backward()
    return ops.host_syncs


def test_gpt_micro_batch_never_syncs_the_host_off_cpu():
    assert run_on_ranks(_host_sync_body, 2, {}) == [0, 0]
    assert run_on_ranks(_host_sync_body, 2, dict(LLAMA, sequence_parallel=True)) == [0, 0]


def _rotary_cache_body():
    """Item 9: rotary tables built once per device and compute dtype, bf16 under autocast."""
    tp.initialize_model_parallel(dist.get_world_size())
    model = _build(GPTConfig(**{**BASE, **LLAMA}), tp.get_tensor_model_parallel_group())
    tokens, _ = _data()
    cpu = torch.device("cpu")
    cos, _ = model._rotary(None, 8, cpu)
    assert cos.dtype == torch.float32 and model._rotary(None, 8, cpu)[0].data_ptr() == cos.data_ptr()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos16, _ = model._rotary(None, 8, cpu)
        model(tokens)
    assert cos16.dtype == torch.bfloat16 and len(model._rotary_tables._built) == 2
    torch.testing.assert_close(cos16, cos.to(torch.bfloat16), rtol=0, atol=0)
    positions = torch.tensor([[3, 4], [0, 1]])
    torch.testing.assert_close(model._rotary(positions, 2, cpu)[0], cos[positions])
    return True


def test_rotary_tables_are_cached_in_the_compute_dtype():
    assert run_on_ranks(_rotary_cache_body, 1) == [True]
