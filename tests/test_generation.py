"""Generation's decode step (models/generation.py) against the model's full recomputation."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.models import GPT, GPTConfig
from tensorpar.models.cuda_graph import CUDAGraphed
from tensorpar.models.generation import Decoder, generate, last_logits
from tests.harness import run_on_ranks
from tests.test_gpt import ATOL, BASE, GQA, LLAMA, RTOL, _build, _single_rank_group

NEW = 6
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Learned positions (GPT-2), GQA with rope, one K/V head for 8 query heads (replicated on
# every rank at TP > 1), uneven heads (6 over TP 4), and SP (a decode step does not split).
CASES = ({}, GQA, {**GQA, "num_query_groups": 1}, {**LLAMA, "num_heads": 6, "hidden_size": 48, "num_query_groups": 2},
         {**GQA, "sequence_parallel": True})


def _prompt():
    """Three prompts of 6, 4 and 1 tokens, left-padded, and their attention mask."""
    prompt = torch.randint(1, BASE["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    mask[2, :5] = 0
    return prompt.masked_fill(mask == 0, 0), mask


def _decode_body(with_tp1: bool, cases):
    tp.initialize_model_parallel(dist.get_world_size(), expert_tensor_parallel_size=1)
    prompt, mask = _prompt()
    batch, length = prompt.shape
    for overrides in cases:
        config = GPTConfig(**{**BASE, **overrides})
        groups = (_single_rank_group(),) * with_tp1 + (tp.get_tensor_model_parallel_group(),)
        for group in groups:
            model = _build(config, group).eval()
            for attention_mask in (None, mask):
                out = model.generate(prompt, NEW, temperature=0, attention_mask=attention_mask)
                recomputed = model.generate(prompt, NEW, temperature=0, attention_mask=attention_mask,
                                            use_cache=False)
                assert torch.equal(out, recomputed), (overrides, attention_mask)
                # The fixed-shape step a CUDA graph captures (here run eagerly): the same tokens.
                fixed = model.generate(prompt, NEW, temperature=0, attention_mask=attention_mask, cuda_graph=True)
                assert torch.equal(fixed, out), (overrides, attention_mask)
            # Each decode step's logits are those of the whole sequence recomputed without a cache.
            # (generate copies the weights from 16 new tokens on: here both ways; and with fixed
            # shapes, the whole cache attended with a mask, garbage in its unused slots.)
            is_real = F.pad(mask.bool(), (0, NEW), value=True)
            with torch.no_grad():
                recomputed = {stop: last_logits(model, out[:, :stop], is_real[:, :stop], None)
                              for stop in range(length + 1, length + NEW + 1)}
            for copy_weights, fixed_shapes in ((False, False), (True, False), (False, True)):
                with torch.no_grad():
                    cache = model.new_kv_cache(batch, length + NEW + 1)
                    for buffer in cache.keys + cache.values:
                        buffer.fill_(float("nan"))
                    decoder = Decoder(model, cache, is_real, prompt=length, copy_weights=copy_weights,
                                      fixed_shapes=fixed_shapes)
                    last_logits(model, out[:, :length], is_real[:, :length], cache)
                    for stop in range(length + 1, length + NEW + 1):
                        what = f"{overrides} fixed_shapes={fixed_shapes} at {stop}"
                        torch.testing.assert_close(decoder.step(out[:, stop - 1]), recomputed[stop],
                                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    return True


@pytest.mark.slow
def test_decode_step_equals_the_recomputation_at_tp_1_2_and_4():
    assert run_on_ranks(_decode_body, 2, True, CASES) == [True] * 2
    # TP 1 ran above. At TP 4 the cases whose split differs from TP 2's (each step's gloo
    # collectives cost 5x theirs at 2 ranks): GPT-2, one K/V head on every rank, 6 heads over 4 ranks.
    assert run_on_ranks(_decode_body, 4, False, CASES[0:1] + CASES[2:4]) == [True] * 4


def test_decode_step_of_a_model_with_experts_equals_the_recomputation_at_tp_1_and_2():
    """The MoE blocks' experts in each decode step, at TP 2 each rank routing its share of the batch."""
    moe = {**LLAMA, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
           "moe_shared_expert_intermediate_size": 8}
    assert run_on_ranks(_decode_body, 2, True, [moe]) == [True] * 2


def _ledger_body():
    tp.initialize_model_parallel(dist.get_world_size())
    config = GPTConfig(**{**BASE, **GQA, "num_query_groups": 1})
    model = _build(config, tp.get_tensor_model_parallel_group()).eval()
    prompt, mask = _prompt()
    with tp.CommLedger() as ledger:
        model.generate(prompt, 3, temperature=0, attention_mask=mask)
    return [(r.op, tuple(r.shape)) for r in ledger.records]


def test_decode_issues_one_collective_per_sub_layer():
    """Per token after the prefill: the embedding's all-reduce, one all-reduce per attention
    and per MLP, the all-gather of the logits; nothing else."""
    records = run_on_ranks(_ledger_body, 2)[0]
    b, s, h, layers = 3, 6, BASE["hidden_size"], BASE["num_layers"]
    logits = ("all_gather", (b, 104))  # the gathered [b, padded vocab]
    token = [("all_reduce", (b, h))] * (1 + 2 * layers) + [logits]
    prefill = [("all_reduce", (b, s, h))] + [("all_reduce", (s, b, h))] * 2 * layers + [logits]
    assert records == prefill + token * 2


def _graph_body(device_type):
    """``generate(cuda_graph=True)`` against the default decode; on CPU, the capture's refusals."""
    tp.initialize_model_parallel(1)
    prompt, mask = _prompt()
    tp.model_parallel_manual_seed(7)
    model = GPT(GPTConfig(**{**BASE, **GQA}), device=device_type).eval()
    prompt, mask = prompt.to(device_type), mask.to(device_type)
    if device_type == "cpu":
        is_real = F.pad(mask.bool(), (0, NEW), value=True)
        refused = []
        for kwargs in (dict(cuda_graph=True), dict(cuda_graph=True, fixed_shapes=True)):
            try:
                Decoder(model, model.new_kv_cache(3, 12), is_real, prompt=6, **kwargs)
            except ValueError as exc:
                refused.append(str(exc))
        try:
            generate(model, prompt, NEW, temperature=0, cuda_graph=True, use_cache=False)
        except ValueError as exc:
            refused.append(str(exc))
        try:
            CUDAGraphed(lambda x: x + 1)(torch.zeros(2))
        except ValueError as exc:
            refused.append(str(exc))
        return refused
    same = []
    for attention_mask in (None, mask):
        eager = generate(model, prompt, NEW, temperature=0, attention_mask=attention_mask)
        graphed = generate(model, prompt, NEW, temperature=0, attention_mask=attention_mask, cuda_graph=True)
        same.append(torch.equal(eager, graphed))
    return same


def test_cuda_graph_is_refused_where_it_cannot_capture():
    (refused,) = run_on_ranks(_graph_body, 1, "cpu")
    assert len(refused) == 4, refused
    assert "fixed_shapes=False on cpu at TP=1" in refused[0] and "fixed_shapes=True on cpu" in refused[1]
    assert "use_cache=True (got False)" in refused[2] and "on cpu" in refused[3]


@pytest.mark.gpu
@cuda
def test_cuda_graph_decode_gives_the_eager_tokens_on_this_gpu():
    """The captured fixed-shape step, replayed per token: the tokens of the default decode (fp32)."""
    assert run_on_ranks(_graph_body, 1, "cuda") == [[True, True]]
