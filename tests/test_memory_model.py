"""The training-memory estimate (:mod:`tensorpar.planning.memory`, :mod:`tensorpar.training.memory`)
under context and pipeline parallelism: the arithmetic, the refusal naming the largest stage,
and one PP and one CP layout against a measured step (``benchmarks/stage_memory.py``'s
measurement, at a tiny size; the benchmark measures the larger ones)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tensorpar.errors import UsageError
from tensorpar.planning.memory import gpt_layer_activations, gpt_training_memory, local_tokens
from tensorpar.models import GPTConfig
from tests.harness import run_in_fresh_world


def _config(**fields):
    return GPTConfig(**{"vocab_size": 256, "max_seq_len": 4096, "num_layers": 2, "num_heads": 4, "hidden_size": 64,
                        **fields})


def test_context_parallelism_divides_the_per_token_activations_not_the_parameters():
    assert local_tokens(4096, tp=1, cp=2, sp=False) == 2048
    assert local_tokens(7, tp=1, cp=2, sp=False) == 4           # padded to 2 x CP chunks: 8
    assert local_tokens(10, tp=2, cp=2, sp=True) == 8           # chunks of a multiple of TP: 16 over 2 CP ranks
    sizes = dict(tp=1, seq_len=1024, micro_batch=2)
    rope = _config(position_embedding="rope", context_parallel_comm="p2p")
    one = gpt_layer_activations(rope, cp=1, **sizes)
    two = gpt_layer_activations(rope, cp=2, **sizes)
    assert [a.name for a in one] == [a.name for a in two]
    assert all(b.numel * 2 == a.numel for a, b in zip(one, two))    # every per-token tensor halves
    # Ulysses keeps Q, K, V again in its head split and no rotated copies.
    a2a = [a.name for a in gpt_layer_activations(_config(position_embedding="rope", context_parallel_comm="a2a"),
                                                 cp=2, **sizes)]
    assert "q, k, v (heads split)" in a2a and "rotated q, k" not in a2a
    memory = {cp: gpt_training_memory(_config(context_parallel_comm="a2a"), cp=cp, dp=2, fsdp=False, **sizes)
              for cp in (1, 2)}
    assert memory[1]["parameters"] == memory[2]["parameters"]
    assert memory[2]["activations"] < 0.55 * memory[1]["activations"]
    # FSDP shards over DP x CP.
    assert gpt_training_memory(rope, cp=2, dp=2, fsdp=True, **sizes)["parameters"] == \
        gpt_training_memory(rope, cp=1, dp=4, fsdp=True, **sizes)["parameters"]


def test_attention_dropout_keeps_the_s_by_s_tensors_of_sdpas_math_path():
    sizes = dict(tp=1, seq_len=256, micro_batch=2)
    fused = gpt_layer_activations(_config(), **sizes)
    math = gpt_layer_activations(_config(dropout=0.1), **sizes)
    assert "softmax output" not in [a.name for a in fused]
    scores = [a for a in math if a.name in ("softmax output", "attention dropout mask", "attention dropout output")]
    assert [a.numel for a in scores] == [2 * 4 * 256 * 256] * 3
    assert sum(a.name.endswith("dropout mask") and a.element_size == 1 for a in math) == 2   # the hidden ones


def test_the_pipeline_estimate_refuses_naming_the_largest_stage(monkeypatch):
    from tensorpar.training import memory

    monkeypatch.setattr(memory, "memory_per_rank", lambda local_ranks: (2**20, "1 MiB per rank"))
    config = GPTConfig(vocab_size=256, max_seq_len=128, num_layers=4, num_heads=2, hidden_size=64)
    with pytest.raises(UsageError) as refused:
        memory.check_memory(config, tp=1, dp=1, seq_len=128, micro_batch=4, dtype="fp32", local_ranks=2, pp=2,
                            schedule="1f1b", microbatches=8)
    message = str(refused.value)
    assert " per rank at --tp 1 on PP rank 0 of --pp 2 (stage 0 with 2 micro-batches in flight under " \
           "--pp-schedule 1f1b) (parameters " in message and "pipeline receive buffers 0.0 GiB" in message
    assert message.endswith("more than 1 MiB per rank: choose a smaller model or batch, or a larger --tp or --pp")
    with pytest.raises(UsageError, match=r"for --micro-batch 4 x --seq-len 128 at --cp 2\), more than"):
        memory.check_memory(config, tp=1, dp=1, seq_len=128, micro_batch=4, dtype="fp32", local_ranks=2, cp=2)


SMALL = SimpleNamespace(layers=4, hidden=64, heads=4, seq=128, batch=2, microbatches=4, vocab=256, warmup=1,
                        cp_seq=512, cp_layers=2)


def _measured(part: str, variant: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import stage_memory

    return (stage_memory._pp_rank if part == "pp" else stage_memory._cp_rank)(SMALL, 2, variant)


@pytest.mark.slow
@pytest.mark.parametrize("part, variant", [("pp", "1f1b"), ("cp", "a2a")])
def test_the_estimate_is_within_ten_percent_of_a_measured_pipeline_stage_and_cp_rank(part, variant):
    # A fresh world: ranks that ran other tests hold caches a step would not allocate.
    for rank, result in enumerate(run_in_fresh_world(_measured, 2, part, variant)):
        assert result["step"] == pytest.approx(result["step_estimate"], rel=0.1), (part, rank, result)
        if part == "pp":
            assert result["held"] == pytest.approx(result["held_estimate"], rel=0.01), (rank, result)
