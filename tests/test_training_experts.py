"""``tensorpar train`` with experts: EP 2 and EP 4, and EP 2 with TP 2 (with SP and without), CP 2, PP 2, FSDP or HSDP,
train the EP 1 run; an EP 2 checkpoint resumes at EP 1 on the uninterrupted losses; what EP refuses.

One micro-batch of one sequence (the balance loss's scope) at every layout, global batch 4.
"""

import json
import warnings

import pytest

from tensorpar.cli.main import main
from tensorpar.cli.training_cli import parse_train_args
from tests.cli_runner import run_tensorpar
from tests.harness import run_on_ranks
from tests.test_training_cli import _train_error

MOE = ["--model", "moe-tiny", "--layers", "2", "--hidden", "32", "--heads", "4", "--num-experts", "4",
       "--moe-ffn-hidden", "16", "--moe-expert-bias", "--seq-len", "16", "--steps", "4", "--warmup", "1",
       "--lr", "1e-2", "--micro-batch", "1", "--global-batch", "4", "--eval-every", "4", "--eval-iters", "1",
       "--log-every", "1", "--no-progress", "--seed", "5"]


def _train_body(argv):
    import contextlib
    import io

    from tensorpar.training.loop import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train(parse_train_args(argv))
    return result.losses, result.val_losses, out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    cases = {"ep1": (1, ["--tp", "1"]), "ep2": (4, ["--tp", "1", "--ep", "2", "--save-every", "2"]),
             "ep4": (4, ["--tp", "1", "--ep", "4"]), "tp2ep2": (4, ["--tp", "2", "--sp", "--ep", "2"]),
             "tp2ep2-no-sp": (4, ["--tp", "2", "--ep", "2"]),
             "cp2ep2": (4, ["--tp", "1", "--cp", "2", "--ep", "2"]),
             "pp2ep2": (4, ["--tp", "1", "--pp", "2", "--ep", "2"]),
             "fsdp-ep2": (4, ["--tp", "1", "--fsdp", "--ep", "2", "--save-every", "2"]),
             "hsdp-ep2": (4, ["--tp", "1", "--fsdp", "--dp-replicate", "2", "--ep", "2"]),
             "resumed": (1, ["--tp", "1", "--resume", str(root / "ep2" / "step_2")]),
             "fsdp resumed": (2, ["--tp", "1", "--ep", "2", "--resume", str(root / "fsdp-ep2" / "step_2")])}
    return root, {name: run_on_ranks(_train_body, world, MOE + flags + ["--out", str(root / name)])
                  for name, (world, flags) in cases.items()}


def _logged(root, name, field):
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return [row[field] for row in rows if "loss" in row]


@pytest.mark.parametrize("name", ["ep2", "ep4", "tp2ep2", "tp2ep2-no-sp", "cp2ep2", "pp2ep2", "fsdp-ep2", "hsdp-ep2"])
def test_expert_parallel_trains_the_ep1_run(runs, name):
    """Losses, grad norm and the experts' balance figures equal EP 1's (the validation loss is of
    --eval-iters batches a DP rank: another amount of data at another DP size)."""
    root, results = runs
    (losses, _, out), = results["ep1"]
    assert list(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    assert "4 experts (top 2) over EP=1, 4 a rank, balanced by aux loss x0.01 and expert bias" in out
    for rank_losses, _, _ in results[name]:
        assert rank_losses == pytest.approx(losses, rel=1e-4)
    for field in ("grad_norm", "moe_aux_loss", "moe_imbalance"):
        assert _logged(root, name, field) == pytest.approx(_logged(root, "ep1", field), rel=1e-4), field


def test_an_ep2_checkpoint_resumes_at_ep1_on_the_uninterrupted_losses(runs):
    """And one saved under FSDP x EP 2 resumes without FSDP on 2 ranks."""
    root, results = runs
    (losses, _, _), = results["ep1"]
    for name in ("resumed", "fsdp resumed"):
        for resumed, _, _ in results[name]:
            assert resumed == pytest.approx({3: losses[3], 4: losses[4]}, rel=1e-4), name
    meta = json.loads((root / "ep2" / "step_2" / "meta.json").read_text())
    assert meta["world"] == {"tp": 1, "dp": 4, "ep": 2}
    # The expert biases, moved by 1e-3 a step towards balance, are in the checkpoint.
    import torch
    import torch.distributed.checkpoint as dcp

    bias = {f"buffer.blocks.{i}.mlp.router.expert_bias": torch.full((4,), 7.0) for i in range(2)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(bias, checkpoint_id=str(root / "ep2" / "step_2"), no_dist=True)
    for value in bias.values():
        assert value.abs().max() > 0 and all(round(abs(v) * 1e3) in (0, 1, 2) for v in value.tolist())


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "2", "--tp", "1", "--ep", "2"], "--ep 2 needs a model with experts: --num-experts, or --model moe-tiny"),
    (["--nproc", "3", "--tp", "1", "--model", "moe-tiny", "--ep", "3"],
     "--num-experts 8 is not divisible by --ep 3: each EP rank holds whole experts"),
    (["--nproc", "2", "--tp", "1", "--model", "moe-tiny", "--ep", "4"],
     "--ep 4 does not divide the 2 TP x CP x DP ranks of a stage (--tp 1 x --cp 1 x DP 2)"),
    (["--nproc", "4", "--tp", "2", "--cp", "2", "--cp-comm", "a2a", "--model", "moe-tiny", "--num-experts", "2",
      "--moe-router-topk", "1", "--tp-invariant"],
     "--tp-invariant with --ep 1 below --tp 2 x --cp 2 = 4 computes each expert on one of those 4 ranks: "
     "--num-experts 2 must divide by 4"),
    (["--nproc", "4", "--tp", "1", "--model", "moe-tiny", "--tp-invariant", "--fsdp", "--pp", "2"],
     "--fsdp with --tp-invariant, experts and --pp 2: a pipeline's expert gradients under FSDP do not enter the "
     "mode's trees yet; drop --fsdp or --pp"),
])
def test_what_expert_parallelism_refuses(capsys, argv, message):
    assert _train_error(capsys, *argv) == message


def test_an_ep2_checkpoint_generates_at_tp_1_and_2_and_exports_as_mixtral(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    root, _ = runs
    texts = [run_tensorpar(["generate", "--checkpoint", root / "ep2", "--prompt", "def ", "--max-new-tokens", "4",
                            "--temperature", "0", "--nproc", nproc, "--tp", nproc]) for nproc in (1, 2)]
    assert all(done.returncode == 0 for done in texts), [done.stderr for done in texts]
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.startswith("def ")
    # Mixtral's router has no expert bias: that run is refused in one line; one without it exports.
    done = run_tensorpar(["export", "--checkpoint", root / "ep2", "--to-hf", tmp_path / "hf"])
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "cannot be exported: a GPT with experts maps to Mixtral only with its layers, an MoE MLP in every "
        "block and its router; this one has moe_router_enable_expert_bias=True")
    plain = [flag for flag in MOE if flag != "--moe-expert-bias"]
    done = run_tensorpar(["train", *plain, "--nproc", "2", "--tp", "1", "--ep", "2", "--steps", "2",
                          "--out", tmp_path / "run"])
    assert done.returncode == 0, done.stderr
    texts = [run_tensorpar(["generate", "--checkpoint", tmp_path / "run", "--prompt", "def ", "--max-new-tokens",
                            "4", "--temperature", "0"])]
    done = run_tensorpar(["export", "--checkpoint", tmp_path / "run", "--to-hf", tmp_path / "hf"])
    assert done.returncode == 0, done.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.model_type == "mixtral" and hf.config.num_local_experts == 4
    prompt = torch.tensor([list(b"def ")])
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert bytes(out[0].tolist()).decode(errors="replace") == texts[0].stdout.rstrip("\n")[:len(out[0])]
