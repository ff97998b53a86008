"""``tensorpar train --pp``: the losses of PP=1 (1F1B and an interleaved schedule, with TP), the
same validation losses (every other schedule too, evaluating between steps), layout-free checkpoints (saved at PP 2, resumed at PP 1, TP 2, DP 2; read
by generate), and the refusals before launch, one line each."""

import subprocess
import sys

import pytest

from tensorpar.cli.main import main
from tests.harness import run_on_ranks

# 4 layers: interleaved 1F1B at PP 2 holds 2 stages per rank. Gradient clipping at 0.5 clips.
TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--steps", "4", "--warmup", "1",
        "--lr", "1e-2", "--no-progress", "--seed", "7", "--global-batch", "4", "--micro-batch", "2",
        "--clip-grad", "0.5", "--eval-every", "2", "--eval-iters", "3", "--save-every", "2"]
# fp32 rounding: the same sums, a few in another order (the grad norm over stages, the tied embedding's).
RTOL = 1e-6


def _train_body(argv):
    from tensorpar.cli.training_cli import parse_train_args
    from tensorpar.training.loop import train

    result = train(parse_train_args(argv))
    return result.losses, result.val_losses


def _train(world, out, *extra):
    return run_on_ranks(_train_body, world, TINY + ["--out", str(out), *extra], timeout=300)


def _assert_close(actual: dict, expected: dict) -> None:
    assert list(actual) == [step for step in expected if step in actual] and actual
    for step, loss in actual.items():
        assert loss == pytest.approx(expected[step], rel=RTOL, abs=0), (step, loss, expected[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_runs")
    out = {"root": root}
    out["pp1"] = _train(1, root / "pp1", "--tp", "1")[0]
    out["1f1b"] = _train(2, root / "1f1b", "--tp", "1", "--pp", "2")
    # Recompute: the schedule's shape inference runs a recomputed block's backward, kept out of main_grad.
    out["interleaved"] = _train(2, root / "il", "--tp", "1", "--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                "--recompute")
    out["tp2xpp2"] = _train(4, root / "tp2pp2", "--tp", "2", "--pp", "2", "--sp")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "interleaved", "tp2xpp2"])
def test_train_at_pp2_gives_the_losses_of_pp1_on_every_rank(runs, name):
    expected_loss, expected_val = runs["pp1"]
    for losses, val in runs[name]:  # every rank reports the same losses
        assert list(losses) == [1, 2, 3, 4] and list(val) == [2, 4]
        _assert_close(losses, expected_loss)
        _assert_close(val, expected_val)


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [(1, ["--tp", "1"]), (2, ["--tp", "2"]), (2, ["--tp", "1"])],
                         ids=["pp1", "tp2xpp1", "pp1xdp2"])
def test_a_pp2_checkpoint_resumes_at_another_layout_on_the_uninterrupted_losses(runs, tmp_path, world, layout):
    losses, val = _train(world, tmp_path / "resumed", *layout, "--resume", str(runs["root"] / "1f1b" / "step_2"))[0]
    assert list(losses) == [3, 4]
    _assert_close(losses, runs["pp1"][0])
    if layout == ["--tp", "2"] or world == 1:  # at DP 2 each DP rank validates batches of its own: other batches
        _assert_close(val, runs["pp1"][1])


# 4 micro-batches of 1 row (dualpipev at PP 2 needs 2 PP); an evaluation after each step: eval, then train again.
EVAL_EVERY_STEP = ["--steps", "2", "--global-batch", "4", "--micro-batch", "1", "--eval-every", "1",
                   "--eval-iters", "2"]


@pytest.fixture(scope="module")
def pp1_evaluating(tmp_path_factory):
    return _train(1, tmp_path_factory.mktemp("pp1_eval"), "--tp", "1", *EVAL_EVERY_STEP)[0]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb", "looped-bfs"])
def test_every_schedule_evaluates_through_the_pipeline_on_the_losses_of_pp1(pp1_evaluating, tmp_path, schedule):
    # torch's eval of the V schedules (zbv, dualpipev) refused the hand-off between a rank's two stages.
    expected_loss, expected_val = pp1_evaluating
    for losses, val in _train(2, tmp_path, "--tp", "1", "--pp", "2", "--pp-schedule", schedule, *EVAL_EVERY_STEP):
        assert list(losses) == [1, 2] and list(val) == [1, 2]
        _assert_close(losses, expected_loss)
        _assert_close(val, expected_val)


def _loss_body(ckpt):
    """The loss of the checkpoint's model, as generate and export load it, on a fixed batch."""
    import torch

    from tensorpar import parallel_state as ps
    from tensorpar.training.inference import load_model

    ps.initialize_model_parallel(1, timeout=60)
    try:
        model, _ = load_model(ckpt, tp_group=ps.get_tensor_model_parallel_group())
        tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            return sorted(name for name, _ in model.named_parameters()), model(tokens[:, :-1], tokens[:, 1:]).item()
    finally:
        ps.destroy_model_parallel()


@pytest.mark.slow
def test_generate_and_export_read_a_pp_checkpoint_as_the_pp1_one(runs, tmp_path, capsys):
    # The weights after AdamW differ from PP=1's in a few elements by the sign of a near-zero
    # gradient's rounding: the loss of the model read tells a misplaced stage, not that.
    names, loss = run_on_ranks(_loss_body, 1, str(runs["root"] / "pp1" / "step_4"))[0]
    for name in ("1f1b", "tp2pp2"):
        pp_names, pp_loss = run_on_ranks(_loss_body, 1, str(runs["root"] / name / "step_4"))[0]
        assert pp_names == names and pp_loss == pytest.approx(loss, rel=1e-5), (name, pp_loss, loss)
    ckpt = str(runs["root"] / "tp2pp2")
    assert main(["generate", "--checkpoint", ckpt, "--nproc", "1", "--tp", "1", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["export", "--checkpoint", ckpt, "--to-hf", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


REFUSED = [
    (["--nproc", "2", "--pp", "4"], "--pp 4 needs at least 4 processes; --nproc is 2"),
    (["--nproc", "6", "--pp", "4"], "--pp 4 does not divide --nproc 6"),
    (["--nproc", "6", "--tp", "2", "--pp", "2"], "--tp 2 x --pp 2 = 4 does not divide --nproc 6"),
    (["--nproc", "6", "--tp", "1", "--pp", "2", "--cp", "2"],
     "--tp 1 x --cp 2 x --pp 2 = 4 does not divide --nproc 6: the world is TP x CP x DP x PP"),
    (["--nproc", "2", "--pp", "2", "--layers", "1", "--grad-accum", "2"],
     "--pp 2 --pp-schedule 1f1b: 2 pipeline stages (PP=2 x 1 per rank) exceed the 1 layers"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "1"],
     "--pp 2 --pp-schedule 1f1b: the 1f1b schedule at PP=2 needs at least PP = 2 micro-batches, got 1"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "2", "--virtual-stages", "2"],
     "2 virtual stages need a multi-stage schedule"),
    (["--nproc", "2", "--virtual-stages", "2"], "--virtual-stages 2 needs --pp greater than 1"),
    (["--nproc", "2", "--pp", "2", "--grad-accum", "2", "--fsdp", "--compile"],
     "--pp 2 cannot combine with --compile (or the resumed run's setting): torch.compile of pipeline stages"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[m.split(":")[0][:30] for _, m in REFUSED])
def test_what_a_pipeline_run_cannot_do_is_refused_before_launch_in_one_line(argv, message, capsys, tmp_path):
    assert main(["train", *argv, "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_the_schedule_flag_names_every_pipeline_schedule():
    from tensorpar import pipeline_parallel as pipeline
    from tensorpar.cli.pipeline_flags import SCHEDULE_NAMES

    assert SCHEDULE_NAMES == tuple(pipeline.SCHEDULES)


_OLDER_TORCH = """
import sys
from torch.distributed.pipelining import PipelineStage
del PipelineStage._backward_metadata_inference  # torch 2.11's stage: no backward shape inference
from tensorpar.cli.main import main
tiny = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16", "--micro-batch", "2", "--steps", "1",
        "--eval-every", "0", "--no-progress", "--tp", "1"]
print("pp1", main(["train", *tiny, "--nproc", "1", "--out", sys.argv[1]]), flush=True)
print("pp2", main(["train", *tiny, "--nproc", "2", "--pp", "2", "--grad-accum", "2", "--out", sys.argv[2]]), flush=True)
"""


@pytest.mark.slow
def test_a_torch_without_the_stage_pp_extends_trains_without_pp_and_refuses_pp_in_one_line(tmp_path):
    # A new interpreter, so that importing tensorpar happens after the stage lost the method.
    done = subprocess.run([sys.executable, "-c", _OLDER_TORCH, str(tmp_path / "a"), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-2:] == ["pp1 0", "pp2 2"], done.stdout + done.stderr
    assert (tmp_path / "a" / "step_1").is_dir()
    refused = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(refused) == 1 and refused[0].startswith(
        "tensorpar train: error: pipeline parallelism needs torch 2.13 or newer"), done.stderr
    assert not (tmp_path / "b").exists()


def test_pp2_on_the_defaults_splits_the_same_global_batch_into_the_schedules_micro_batches(tmp_path):
    """`--pp 2` on the defaults failed ("needs at least PP = 2 micro-batches, got 1"): without
    --micro-batch the default global batch of 16 runs as the 1F1B schedule's 2 micro-batches of 8,
    and the header says so."""
    from tests.cli_runner import run_tensorpar

    argv = ["train", "--nproc", "2", "--tp", "1", "--pp", "2", "--layers", "2", "--hidden", "16", "--heads", "2",
            "--seq-len", "16", "--steps", "1", "--no-progress", "--out", str(tmp_path / "run")]
    done = run_tensorpar(argv)
    assert done.returncode == 0, done.stderr
    assert ("global batch 16 sequences (8 per micro-batch x 1 DP x 2 accumulation)" in done.stdout
            and "(micro-batch 8: the 1f1b schedule's 2 micro-batches; --micro-batch sets it" in done.stdout), done.stdout
    assert "micro-batch-chosen" not in done.stdout
