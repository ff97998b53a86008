"""End to end at a tiny size: DP equivalence, resuming at other TP sizes, exact same-size resume.

One shared sequence of runs (module fixture), on the harness's persistent worlds:
A = TP1 x DP1; B = TP2 x DP2 (same global batch, checkpoints at steps 3 and 6); B resumed from
step 3 at TP2 x DP2 (must equal B exactly), at TP1 and at TP4.
"""

import json

import pytest
import torch

from tensorpar.cli.training_cli import parse_train_args
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--steps", "6",
        "--warmup", "2", "--lr", "1e-2", "--eval-every", "0", "--no-progress", "--seed", "7"]


def _train_body(argv):
    from tensorpar.training.loop import train

    result = train(parse_train_args(argv))
    return result.losses, result.checkpoint


def _train(world, tp, micro, out, *extra):
    micro_flag = ["--micro-batch", str(micro)] if micro else []
    argv = TINY + ["--tp", str(tp), *micro_flag, "--out", str(out), *extra]
    results = run_on_ranks(_train_body, world, argv)
    return results[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    a, _ = _train(1, 1, 4, root / "a")
    b, _ = _train(4, 2, 2, root / "b", "--save-every", "3")
    # tp2dp2 extends the run to 8 steps; tp1 (DP 1) gets no --micro-batch: accumulation adapts.
    resumed = {name: _train(world, tp, micro, root / name, "--resume", str(root / "b" / "step_3"), *extra)[0]
               for name, world, tp, micro, extra in (("tp2dp2", 4, 2, 2, ("--steps", "8")),
                                                     ("tp1", 1, 1, None, ()), ("tp4", 4, 4, 4, ()))}
    return root, a, b, resumed


def test_tp2_dp2_matches_tp1_dp1_on_the_same_global_batch(runs):
    _, a, b, _ = runs
    assert list(a) == list(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=2e-5)
    assert a[6] < a[1] - 0.5  # it learns


def test_resume_continues_the_run_exactly_and_keeps_its_schedule(runs):
    """Extending the run (--steps 8) keeps the saved cosine horizon (6): steps 4-6 are unchanged."""
    root, _, b, resumed = runs
    assert list(resumed["tp2dp2"]) == [4, 5, 6, 7, 8]
    assert {step: resumed["tp2dp2"][step] for step in (4, 5, 6)} == {step: b[step] for step in (4, 5, 6)}
    meta = json.loads((root / "tp2dp2" / "step_8" / "meta.json").read_text())
    assert meta["schedule"]["decay_steps"] == 6 and meta["steps"] == 8 and meta["global_batch"] == 4


@pytest.mark.parametrize("name", ["tp1", "tp4"])
def test_resume_at_another_tp_size_continues_the_run(runs, name):
    _, _, b, resumed = runs
    assert list(resumed[name]) == [4, 5, 6]
    for step, loss in resumed[name].items():
        assert loss == pytest.approx(b[step], rel=2e-5)


def test_outputs_metrics_plot_and_tp_independent_checkpoint(runs):
    root, _, _, _ = runs
    out = root / "b"
    assert (out / "latest").read_text().strip() == "step_6"
    assert sorted(p.name for p in out.glob("step_*")) == ["step_3", "step_6"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr", "tokens_per_s", "grad_norm"} <= set(rows[0])
    assert (out / "loss.png").stat().st_size > 1000
    meta = json.loads((out / "step_6" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["world"] == {"tp": 2, "dp": 2} and meta["data"]["position"] == 6
    config = json.loads((out / "step_6" / "config.json").read_text())
    assert config["num_layers"] == 2 and config["hidden_size"] == 32


def _mismatch_body(argv):
    from tensorpar.training.loop import train
    from tensorpar.training.model_config import ConfigMismatch

    with pytest.raises(ConfigMismatch, match=r"hidden_size: checkpoint 32, requested 64.*num_layers: "
                                             r"checkpoint 2, requested 3"):
        train(parse_train_args(argv))
    return True


def test_resuming_with_another_model_shape_names_the_fields(runs):
    root = runs[0]
    argv = TINY + ["--layers", "3", "--hidden", "64", "--tp", "1", "--out", str(root / "mismatch"),
                   "--resume", str(root / "b")]
    assert run_on_ranks(_mismatch_body, 1, argv) == [True]


def _sampler_body():
    import tensorpar as tp
    from tensorpar.training.data import BatchSampler

    tp.initialize_model_parallel(2)
    tokens = torch.arange(10_000)
    sampler = BatchSampler(tokens, seq_len=16, micro_batch=3, grad_accum=2,
                           dp_rank=tp.get_data_parallel_rank(), dp_size=tp.get_data_parallel_world_size(),
                           seed=5)
    return [x for x, _ in sampler.micro_batches(4)]


def test_tp_ranks_share_a_batch_and_dp_ranks_split_the_global_batch():
    ranks = run_on_ranks(_sampler_body, 4)  # TP groups {0,1} {2,3}; DP groups {0,2} {1,3}
    for k in range(2):
        assert torch.equal(ranks[0][k], ranks[1][k]) and torch.equal(ranks[2][k], ranks[3][k])
        assert not torch.equal(ranks[0][k], ranks[2][k])
    from tensorpar.training.data import BatchSampler

    whole = BatchSampler(torch.arange(10_000), seq_len=16, micro_batch=6, grad_accum=2, dp_rank=0,
                         dp_size=1, seed=5).micro_batches(4)
    for k in range(2):
        assert torch.equal(torch.cat([ranks[0][k], ranks[2][k]]), whole[k][0])


def test_sp_recompute_fusion_and_accumulation_keep_tp2_dp2_equal_to_tp1_dp1(tmp_path):
    """The fp32 main_grad path (fusion + bucketed DP) with SP grads and recompute, 2 micro-batches,
    collectives chunked against their GEMMs and interleaved micro-batch halves."""
    extra = ("--sp", "--recompute", "--grad-fusion", "--grad-accum", "2", "--overlap", "2", "--interleave", "2")
    # Micro-batches of 4 and 2: interleaving needs a sequence per half (one made it a no-op).
    a, _ = _train(1, 1, 4, tmp_path / "a", *extra)
    b, _ = _train(4, 2, 2, tmp_path / "b", *extra)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=2e-5)
    assert a[6] < a[1] - 0.5


def _host_sync_body(argv):
    """Item 8: no step waits for the device to read its loss or grad norm back: they are read
    at log lines only, all pending steps in one transfer (``tolist``, not a dispatched read).

    The loss accumulates in float64; the grad norm is made float64 here, so that the reads the
    loop does are the float64 ones (the optimizer reads its CPU step counters, which are no
    device sync on a GPU either)."""
    import unittest.mock

    from tensorpar.data_parallel import grads
    from tensorpar.training import loop
    from tests.op_counter import HOST_SYNC, OpCounter

    class Float64Reads(OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is HOST_SYNC and args[0].dtype == torch.float64:
                self.counts["float64"] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    norm = grads.get_grad_norm
    with unittest.mock.patch.object(grads, "get_grad_norm", lambda *a, **k: norm(*a, **k).double()), \
            unittest.mock.patch("tensorpar.errors._reads_back", lambda t: False), Float64Reads() as ops:
        result = loop.train(parse_train_args(argv))
    return ops.counts["float64"], sorted(result.losses)


def test_training_reads_losses_back_only_when_logging():
    argv = TINY + ["--tp", "1", "--micro-batch", "2", "--log-every", "4", "--global-batch", "2", "--steps", "5",
                   "--clip-grad", "0"]   # the norm then comes from get_grad_norm, made float64 here
    assert run_on_ranks(_host_sync_body, 1, argv)[0] == (0, [1, 2, 3, 4, 5])


def _count_body(tp):
    import tensorpar
    from tensorpar.models.gpt import GPT, GPTConfig
    from tensorpar.training.model_config import count_parameters

    tensorpar.initialize_model_parallel(tp)
    model = GPT(GPTConfig.preset("tiny", vocab_size=257))
    return count_parameters(model), sum(p.numel() for p in model.parameters()), model.padded_vocab_size


def test_parameter_count_is_the_unpadded_models_at_every_tp_size():
    (tp1, numel, padded), = run_on_ranks(_count_body, 1, 1)
    assert tp1 == numel - (padded - 257) * 128  # the tied embedding's padding rows are not parameters
    assert [r[0] for r in run_on_ranks(_count_body, 2, 2)] == [tp1, tp1]
    assert [r[0] for r in run_on_ranks(_count_body, 4, 4)] == [tp1] * 4


def _evaluate_body():
    import warnings

    from tensorpar.training.data import BatchSampler
    from tensorpar.training.evaluation import evaluate

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.grad_enabled = torch.nn.Parameter(torch.ones(())), []

        def forward(self, tokens, labels):
            self.grad_enabled.append(torch.is_grad_enabled())
            return self.weight * tokens.float().mean()

    model = Probe()
    sampler = BatchSampler(torch.arange(1000), seq_len=8, micro_batch=2, grad_accum=1, dp_rank=0, dp_size=1,
                           seed=0, stream=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluate(model, sampler, iters=2, dtype="fp32", device=torch.device("cpu"), dp_group=None)
    return model.grad_enabled, [str(w.message) for w in caught]


def test_evaluation_builds_no_autograd_graph_and_warns_nothing():
    assert run_on_ranks(_evaluate_body, 1) == [([False, False], [])]


def _captured_train_body(argv):
    import contextlib
    import io

    from tensorpar.training.loop import train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = train(parse_train_args(argv))
    return result.losses, sorted(result.val_losses), out.getvalue(), err.getvalue()


def test_a_resume_continues_every_setting_of_the_run_and_names_what_changed(tmp_path):
    """Left out on resume, --data, --seq-len, --seed, --tensorboard and the evaluation and logging
    intervals are the run's: the resumed steps equal an uninterrupted run's. A changed value is named
    in the one header line, and a schedule that ends before --steps is said to."""
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 300)
    settings = ["--data", str(text), "--seq-len", "16", "--seed", "3", "--tensorboard", "--eval-every", "2",
                "--eval-iters", "1", "--log-every", "1", "--lr-decay-steps", "6"]
    base = ["--layers", "2", "--hidden", "32", "--heads", "4", "--micro-batch", "2", "--warmup", "1",
            "--no-progress", "--tp", "1"]
    whole = run_on_ranks(_captured_train_body, 1, base + settings + ["--steps", "6", "--out", str(tmp_path / "c")])
    run_on_ranks(_captured_train_body, 1, base + settings + ["--steps", "4", "--out", str(tmp_path / "a")])
    losses, evaluated, out, err = run_on_ranks(_captured_train_body, 1, base + [
        "--resume", str(tmp_path / "a"), "--steps", "6", "--out", str(tmp_path / "a")])[0]
    assert losses == {step: whole[0][0][step] for step in (5, 6)} and evaluated == [6]
    assert out.splitlines()[-1] == (f"tensorpar train: resuming {tmp_path / 'a' / 'step_4'} at step 4 of 6: TP 1->1, "
                                    f"DP 1->1; data: --data {text} from step 4; schedule lr 0.003, warmup 1, cosine to "
                                    "0.0003 at step 6; no setting changed")
    assert "schedule" not in err
    meta = json.loads((tmp_path / "a" / "step_6" / "meta.json").read_text())
    assert {k: meta["settings"][k] for k in ("data", "seq_len", "seed", "tensorboard", "eval_every", "log_every")} \
        == {"data": str(text), "seq_len": 16, "seed": 3, "tensorboard": True, "eval_every": 2, "log_every": 1}
    assert len(list((tmp_path / "a" / "tensorboard").iterdir())) == 2  # TensorBoard went on
    _, _, out, err = run_on_ranks(_captured_train_body, 1, base + [
        "--resume", str(tmp_path / "a" / "step_4"), "--steps", "8", "--seq-len", "8", "--no-tensorboard",
        "--out", str(tmp_path / "b")])[0]
    assert out.splitlines()[-1].endswith("cosine to 0.0003 at step 6; changed: --seq-len 16 -> 8, "
                                         "--tensorboard on -> off")
    assert err.splitlines()[0] == ("tensorpar train: the schedule reaches --min-lr 0.0003 at step 7, so steps "
                                   "7-8 train at 0.0003; to decay over the whole run instead, pass "
                                   "--lr-decay-steps 8")
    assert not (tmp_path / "b" / "tensorboard").exists()


def _generate_body(argv):
    import argparse

    from tensorpar.cli.training_cli import register
    from tensorpar.training.inference import generate

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return generate(parser.parse_args(["generate", *argv]))


def test_train_and_generate_calibrate_overlap_auto(tmp_path):
    """overlap="auto" needs tp.calibrate_overlap before a forward: train does it, and generate
    does it for a checkpoint trained so (overlap is saved in its config)."""
    losses, _ = _train(2, 2, 2, tmp_path / "run", "--steps", "2", "--sp", "--overlap", "auto")
    assert list(losses) == [1, 2]
    texts = run_on_ranks(_generate_body, 2, ["--checkpoint", str(tmp_path / "run"), "--tp", "2",
                                             "--prompt", "def ", "--max-new-tokens", "3"])
    assert texts[0] == texts[1] and texts[0].startswith("def ")


def test_uneven_heads_kv_heads_ffn_and_sp_sequence_at_tp3_train_like_tp1(tmp_path):
    """Issue 17 from scratch: 6 heads over 2 K/V heads and an FFN of 200 at TP 3 (uneven heads,
    replicated K/V heads, uneven FFN), under SP at a sequence of 31 (padded): TP=1's losses."""
    shape = ["--heads", "6", "--kv-heads", "2", "--hidden", "48", "--ffn-hidden", "200", "--norm", "rmsnorm",
             "--activation", "swiglu", "--position-embedding", "rope", "--rope-theta", "1e6", "--seq-len", "31"]
    a, _ = _train(1, 1, 4, tmp_path / "a", *shape)
    b, _ = _train(3, 3, 4, tmp_path / "b", "--sp", *shape)
    assert list(a) == list(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert a[6] < a[1] - 0.5
