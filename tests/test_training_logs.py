"""What a run's log says: the step-1 line and every field of each line and metrics row (rates
per device, TFLOP/s, MFU where the device's peak is known, memory, elapsed, ETA), the FLOPs
per token against a hand count and torch's own FLOP counter, the run-config block, the
compile lines, the fine-tune header, and the Weights & Biases logger (a recording fake)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
import torch

from tensorpar.models.config import GPTConfig
from tensorpar.cli.main import main
from tensorpar.cli import config_file
from tensorpar.cli.training_cli import parse_train_args, train_parser
from tensorpar.training.flops import flops_per_token, peak_flops_per_s
from tensorpar.training.metrics import Rates
from tensorpar.training.progress import METRICS, read_rows
from tests.cli_runner import run_tensorpar
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--warmup", "1", "--eval-every", "0", "--no-progress", "--seed", "5"]
ROW_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
              "max_rss_mib", "elapsed_s", "eta_s"}
LINE = (r"tensorpar: step {step}/{steps} loss \d+\.\d{{4}} lr \d\.\d\de[-+]\d\d grad norm \d+\.\d{{3}} \| "
        r"[\d,]+ tokens/s/device, [\d.e+-]+ TFLOP/s/device \| memory [\d,.]+ (MiB|GiB) peak RSS \| "
        r"elapsed \d+:\d\d:\d\d, ETA \d+:\d\d:\d\d")


# ------------------------------------------------------------------ FLOPs per token, peaks, MFU

def test_flops_per_token_is_the_hand_count():
    """2 layers, hidden 32, 4 heads of 8 over 2 K/V heads, SwiGLU FFN 100, vocabulary 300, sequence 16."""
    config = GPTConfig(vocab_size=300, max_seq_len=16, num_layers=2, num_heads=4, hidden_size=32,
                       ffn_hidden_size=100, num_query_groups=2, activation="swiglu")
    qkv, proj, mlp, head = 32 * (32 + 2 * 2 * 8), 32 * 32, 3 * 32 * 100, 32 * 300
    weights = 2 * (qkv + proj + mlp) + head
    assert weights == 34_944
    assert flops_per_token(config, seq_len=16) == 6 * weights + 12 * 2 * 32 * 16 == 221_952


def test_flops_per_token_of_gpt2_small_is_megatrons_closed_form():
    """Narayanan et al. (2021): 72 l h^2 + 12 l h s + 6 V h per token, for a GPT-2 block (FFN 4h)."""
    l, h, s, v = 12, 768, 1024, 50257
    assert flops_per_token(GPTConfig.preset("small"), seq_len=s) == 72 * l * h * h + 12 * l * h * s + 6 * v * h


def _written_out_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
    from tensorpar.models.traced_attention import written_out_attention

    assert dropout_p == 0.0
    return written_out_attention(q, k, v, mask=attn_mask, causal=is_causal, gqa=enable_gqa, drop=lambda p: p)


def _counted_flops_body(activation):
    import unittest.mock

    from torch.utils.flop_counter import FlopCounterMode

    import tensorpar
    from tensorpar.models.gpt import GPT

    tensorpar.initialize_model_parallel(1)
    config = GPTConfig(vocab_size=256, max_seq_len=16, num_layers=2, num_heads=4, hidden_size=32,
                       ffn_hidden_size=48, num_query_groups=2, activation=activation)
    model = GPT(config)
    tokens = torch.randint(0, 256, (3, 16))
    # The counter has no formula for SDPA's CPU kernel: attention written out, as products it counts.
    with unittest.mock.patch("torch.nn.functional.scaled_dot_product_attention", _written_out_sdpa), \
            FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    return counter.get_total_flops(), flops_per_token(config, seq_len=16) * tokens.numel()


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_flops_per_token_is_what_torch_counts_in_a_forward_and_backward_pass(activation):
    """A vocabulary of 256 has no padding rows, so every product the model runs is the model's."""
    [(counted, ours)] = run_on_ranks(_counted_flops_body, 1, activation)
    assert counted == ours


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "bf16", 835e12), ("NVIDIA H200", "bf16", 989e12), ("NVIDIA H200 NVL", "bf16", 835e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12), ("NVIDIA A100 80GB PCIe", "bf16", 312e12),
    ("NVIDIA GeForce RTX 4090", "bf16", None), ("NVIDIA H100 80GB HBM3", "fp32", None), (None, "bf16", None),
])
def test_peaks_are_the_dense_bf16_ones_of_known_cuda_devices_only(name, dtype, peak):
    value, source = peak_flops_per_s(name, dtype=dtype)
    assert value == peak
    assert ("MFU is not logged" in source) == (peak is None)


def test_rates_split_the_world_and_give_mfu_only_with_a_peak():
    assert Rates(devices=4, flops_per_token=10**9, peak_flops_per_s=1e15).fields(tokens_per_s=4e5) == \
        {"tokens_per_s_per_device": 1e5, "tflops_per_device": 100.0, "mfu": 0.1}
    assert Rates(devices=2, flops_per_token=10**6, peak_flops_per_s=None).fields(tokens_per_s=3e3) == \
        {"tokens_per_s_per_device": 1.5e3, "tflops_per_device": 1.5e-3}


# ------------------------------------------------------------------ a short 2-process run

def _captured_train_body(argv):
    import contextlib
    import io

    from tensorpar.training.loop import train

    args = parse_train_args(argv)
    out, err = io.StringIO(), io.StringIO()  # not terminals: plain log lines
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        train(args)
    return dataclasses.asdict(args), out.getvalue(), err.getvalue()  # the settings as the run resolved them


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs") / "run"
    argv = TINY + ["--tp", "1", "--steps", "4", "--log-every", "2", "--out", str(out)]
    results = run_on_ranks(_captured_train_body, 2, argv)
    return out, results


def test_every_logged_step_and_step_1_is_a_line_with_every_field(two_ranks):
    out, [(_, _, err), (_, rank1_out, rank1_err)] = two_ranks
    lines = [line for line in err.splitlines() if line.startswith("tensorpar: step")]
    assert [line.split(" loss")[0] for line in lines] == ["tensorpar: step 1/4", "tensorpar: step 2/4",
                                                          "tensorpar: step 4/4"]
    for step, line in zip((1, 2, 4), lines):
        assert re.fullmatch(LINE.format(step=step, steps=4), line), line
        assert "MFU" not in line  # no peak is known for a CPU
    assert line.endswith("ETA 0:00:00")
    assert rank1_out == rank1_err == ""  # rank 0 reports


def test_each_metrics_row_has_the_rates_per_device_and_the_memory(two_ranks):
    out, _ = two_ranks
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 4]
    config = GPTConfig(vocab_size=257, max_seq_len=32, num_layers=2, num_heads=4, hidden_size=32)
    for row in rows:
        assert set(row) == ROW_FIELDS, row
        assert row["tokens_per_s_per_device"] == pytest.approx(row["tokens_per_s"] / 2, abs=0.05)
        assert row["tflops_per_device"] == pytest.approx(
            row["tokens_per_s"] / 2 * flops_per_token(config, seq_len=32) / 1e12, rel=1e-4)
        assert row["max_rss_mib"] > 50 and row["eta_s"] >= 0 and row["elapsed_s"] > 0
    assert [row["elapsed_s"] for row in rows] == sorted(row["elapsed_s"] for row in rows)
    assert rows[-1]["eta_s"] == 0


def _config_block(stdout: str) -> dict:
    lines = stdout.splitlines()
    assert lines[0] == "tensorpar train: run config (every effective setting, as TOML)", lines[0]
    end = next(i for i, line in enumerate(lines[1:], 1) if line.startswith("tensorpar train:"))
    return tomllib.loads("\n".join(lines[1:end]))


def test_the_log_begins_with_every_effective_setting_as_toml(two_ranks):
    out, [(settings, stdout, _), _] = two_ranks
    config = _config_block(stdout)
    applies = settings["eval_every"] if settings["save_every"] is None else settings["save_every"]
    how_it_ran = {"given_settings", "run_config", "micro_batch_chosen", "data_from_checkpoint"}  # what resolving added
    assert config["run"] == {name.replace("_", "-"): value for name, value in settings.items()
                             if value is not None and name not in how_it_ran} | {
        "save-every": applies}  # None (at every evaluation) shown as the interval that applies
    # What was left out is there as the run resolved it.
    assert {k: config["run"][k] for k in ("global-batch", "grad-accum", "lr", "min-lr", "lr-decay-steps",
                                          "save-every", "dtype", "wandb", "tensorboard")} == \
        {"global-batch": 4, "grad-accum": 1, "lr": 3e-3, "min-lr": 3e-4, "lr-decay-steps": 4, "save-every": 0,
         "dtype": "fp32", "wandb": False, "tensorboard": False}
    assert {k: config["model"][k] for k in ("num_layers", "hidden_size", "num_heads", "vocab_size")} == \
        {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 257}
    derived = config["derived"]
    assert {k: derived[k] for k in ("tp_size", "dp_size", "devices", "device", "tokens_per_step")} == \
        {"tp_size": 1, "dp_size": 2, "devices": 2, "device": "cpu", "tokens_per_step": 128}
    assert "peak_flops_per_s" not in derived and derived["peak_flops_source"].startswith("no peak is known for a CPU")
    assert "# data: not set" in stdout
    # The [run] table's lines are a config file that gives the same run.
    run_table = stdout.split("[run]\n", 1)[1].split("\n[model]", 1)[0]
    (out.parent / "from-log.toml").write_text(run_table)
    again = config_file.read(str(out.parent / "from-log.toml"), parser=train_parser())
    assert again == {name: value for name, value in settings.items()
                     if value is not None and name not in how_it_ran} | {"save_every": applies}


def _slow_evaluation_and_save_body(argv, pause):
    from tensorpar.training import loop

    def slowly(fn):
        def wrapper(*args, **kwargs):
            time.sleep(pause)
            return fn(*args, **kwargs)
        return wrapper

    evaluate, save = loop.evaluate, loop._save
    loop.evaluate, loop._save = slowly(evaluate), slowly(save)
    try:
        return _captured_train_body(argv)
    finally:
        loop.evaluate, loop._save = evaluate, save


def test_tokens_per_s_counts_training_steps_not_evaluations_or_saves(tmp_path):
    """Seen on the H200: the rate logged after each evaluation and save was a quarter of the others'."""
    pause = 1.0
    argv = TINY + ["--tp", "1", "--steps", "4", "--log-every", "2", "--eval-every", "2", "--save-every", "2",
                   "--out", str(tmp_path / "run")]
    [(settings, _, _)] = run_on_ranks(_slow_evaluation_and_save_body, 1, argv, pause)
    rows = {row["step"]: row for row in read_rows(tmp_path / "run" / METRICS)
            if "tokens_per_s" in row}  # not the validation rows
    tokens_per_step = settings["global_batch"] * settings["seq_len"]
    # Steps 3 and 4 come after step 2's evaluation and save (2 x pause): their interval has neither.
    assert 2 * tokens_per_step / rows[4]["tokens_per_s"] < 2 * pause, rows[4]


# ------------------------------------------------------------------ the compile lines

def _compile_body(argv):
    import functools

    compile_ = torch.compile
    # Dynamo's tracing (what takes the time) without a C++ build on 2 cores.
    torch.compile = functools.partial(compile_, backend="eager")
    try:
        return _captured_train_body(argv)
    finally:
        torch.compile = compile_


@pytest.mark.slow
def test_compile_says_it_is_compiling_and_how_long_the_first_step_took(tmp_path):
    argv = TINY + ["--tp", "1", "--steps", "2", "--compile", "--out", str(tmp_path / "run")]
    [(_, _, err)] = run_on_ranks(_compile_body, 1, argv)
    lines = err.splitlines()
    starts = lines.index("tensorpar: compiling the model (torch.compile) during the first step: this can take minutes")
    first = next(i for i, line in enumerate(lines) if line.startswith("tensorpar: step 1/2"))
    done = [i for i, line in enumerate(lines) if line.startswith("tensorpar: compiled: the first step took ")]
    assert starts < first < done[0] and len(done) == 1, err
    assert lines[done[0]].endswith("s, compiling included")
    # Step 1's rate is the compiler's: no ETA from it (a 13-minute one on the H200 for a 40 s run).
    step_lines = [line for line in lines if re.match(r"tensorpar: step \d+/", line)]
    assert "ETA" not in step_lines[0] and step_lines[-1].endswith("ETA 0:00:00"), step_lines
    rows = [row for row in read_rows(tmp_path / "run" / METRICS) if "loss" in row]  # not the validation rows
    assert "eta_s" not in rows[0] and rows[-1]["eta_s"] == 0, rows


# ------------------------------------------------------------------ the fine-tune header

def test_a_fine_tune_from_a_checkpoint_names_it(two_ranks, tmp_path):
    out, _ = two_ranks
    argv = TINY + ["--tp", "1", "--steps", "1", "--init-from", str(out), "--out", str(tmp_path / "tuned")]
    [(_, stdout, _)] = run_on_ranks(_captured_train_body, 1, argv)
    assert (f"tensorpar train: initialized from the weights of {out / 'step_4'} (step 4 of its run, at TP 1); "
            "a fresh optimizer and schedule from step 0") in stdout.splitlines()


def test_a_fine_tune_from_a_hugging_face_model_names_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(model_dir)
    argv = TINY[6:] + ["--tp", "1", "--steps", "1", "--init-from-hf", str(model_dir), "--out", str(tmp_path / "run")]
    [(_, stdout, _)] = run_on_ranks(_captured_train_body, 1, argv)
    assert (f"tensorpar train: initialized from the Hugging Face model {model_dir.resolve()} (llama, 1 layers, "
            "hidden 32); a fresh optimizer and schedule from step 0") in stdout.splitlines()


# ------------------------------------------------------------------ --wandb

FAKE_WANDB = textwrap.dedent('''
    """A stand-in for wandb that records each call (and the rank making it) to $FAKE_WANDB_CALLS."""
    import json
    import os


    def _record(*call):
        with open(os.environ["FAKE_WANDB_CALLS"], "a") as f:
            f.write(json.dumps([os.environ.get("RANK"), os.environ.get("WANDB_MODE"), *call]) + "\\n")


    class _Run:
        def log(self, data, step=None):
            _record("log", data, step)

        def finish(self):
            _record("finish")


    def init(**kwargs):
        _record("init", kwargs)
        return _Run()
''')


@pytest.mark.slow
def test_wandb_logs_the_config_and_every_row_from_rank_0_only(tmp_path):
    """Two real ranks through the command, the fake wandb on their path, WANDB_MODE=offline."""
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "wandb.py").write_text(FAKE_WANDB)
    calls, out = tmp_path / "calls.jsonl", tmp_path / "run"
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{src}", "FAKE_WANDB_CALLS": str(calls),
           "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_PROJECT", None)
    done = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--nproc", "2", "--tp", "1", *TINY,
                           "--steps", "4", "--log-every", "2", "--eval-every", "4", "--eval-iters", "1", "--wandb",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert any(line.startswith("tensorpar: step 1/4 loss") for line in done.stderr.splitlines()), done.stderr
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert {(rank, mode) for rank, mode, *_ in recorded} == {("0", "offline")}
    names = [call[2] for call in recorded]
    assert names == ["init", "log", "log", "log", "log", "finish"], names
    init = recorded[0][3]
    assert (init["project"], init["name"], init["dir"]) == ("tensorpar", "run", str(out))
    assert init["config"]["run"]["wandb"] is True and init["config"]["run"]["steps"] == 4
    assert init["config"]["model"]["num_layers"] == 2 and init["config"]["derived"]["devices"] == 2
    logged = [(call[4], sorted(call[3])) for call in recorded[1:-1]]
    fields = sorted(ROW_FIELDS - {"step"})
    assert logged == [(1, fields), (2, fields), (4, fields), (4, ["val_loss"])]


def test_wandb_without_the_package_is_refused_in_one_line(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert main(["train", "--wandb", "--nproc", "1", *TINY]) == 2
    assert capsys.readouterr().err == ("tensorpar train: error: --wandb needs the wandb package, which is not "
                                       "installed: pip install wandb\n")
    from tensorpar.errors import UsageError
    from tensorpar.training.progress import check_wandb

    resumed = {"settings": {"wandb": True}}
    with pytest.raises(UsageError, match=r"pip install wandb \(the resumed run logged to W&B: --no-wandb "
                                         r"continues it without\)$"):
        check_wandb(None, resumed)
    check_wandb(False, resumed)
    check_wandb(None, None)


def test_a_command_prints_the_settings_it_gave_and_config_toml_holds_all(tmp_path):
    """The log's first lines: the settings the command line and --config gave, nothing else."""
    (tmp_path / "given.toml").write_text("lr = 0.001\n")
    done = run_tensorpar(["train", "--nproc", "1", "--tp", "1", "--layers", "1", "--hidden", "16", "--heads", "2",
                          "--seq-len", "16", "--steps", "1", "--eval-every", "0", "--no-progress",
                          "--config", tmp_path / "given.toml", "--out", tmp_path / "run"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"tensorpar train: settings given (the rest are defaults; all of them: {tmp_path / 'run'}" \
                       "/config.toml)"
    end = next(i for i, line in enumerate(lines[1:], 1) if line.startswith("tensorpar train:"))
    given = tomllib.loads("\n".join(lines[1:end]))["run"]
    assert given == {"nproc": 1, "tp": 1, "layers": 1, "hidden": 16, "heads": 2, "seq-len": 16, "steps": 1,
                     "eval-every": 0, "no-progress": True, "lr": 0.001, "out": str(tmp_path / "run")}
    written = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert {"micro-batch", "global-batch", "min-lr", "warmup", "dtype", "seed"} <= set(written)


def test_a_seq_len_beyond_a_presets_learned_positions_says_how_the_table_grows(tmp_path):
    """Issue 62 item 8: the positions (and the parameter count) grew without a word."""
    done = run_tensorpar(["train", "--model", "tiny", "--layers", "1", "--seq-len", "300", "--micro-batch", "1",
                          "--nproc", "1", "--tp", "1", "--steps", "1", "--eval-every", "0", "--no-progress",
                          "--out", tmp_path / "run"])
    assert done.returncode == 0, done.stderr
    assert ("--seq-len 300: the tiny preset's learned positions grow from 256 to 300 rows (5,632 parameters more)"
            in done.stdout + done.stderr)


def test_a_terminal_that_reports_no_width_gets_the_log_lines(monkeypatch):
    """A pseudo-terminal reports 0 x 0 until its size is set (a serial console, ``script`` without
    a window): the bar drew nothing there, and no line was printed either."""
    import pty

    from tensorpar.training.progress import Progress

    master, slave = pty.openpty()
    with open(slave, "w", closefd=True) as terminal:
        assert terminal.isatty() and os.get_terminal_size(slave).columns == 0
        monkeypatch.setattr(sys, "stderr", terminal)
        progress = Progress(out=None, total_steps=2, first_step=0, enabled=True)
        for step in (1, 2):
            progress.step(step=step, loss=4.5, lr=1e-3, tokens_per_s=100.0, grad_norm=1.0, log=True)
        terminal.flush()
    shown = b""
    while True:  # until the closed terminal's end (EIO on Linux)
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    shown = shown.decode()
    assert "step 1/2 loss 4.5000" in shown and "step 2/2 loss 4.5000" in shown, shown
