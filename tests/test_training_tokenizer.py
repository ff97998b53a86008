"""Fine-tuning a local Hugging Face model from the command line, with its tokenizer: prepare,
train --init-from-hf, generate, export, and a transformers pipeline on the export."""

import json
import shutil
import subprocess

import pytest
import torch

from tensorpar.cli.main import main
from tests.cli_runner import run_tensorpar

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TEXT = "".join(f"the quick brown fox {i % 7} jumps over the lazy dog {i % 5}.\n" for i in range(400))


@pytest.fixture(scope="module")
def local_llama(tmp_path_factory):
    """A tiny random Llama saved with a byte-level BPE tokenizer, and the text it was trained on."""
    from tensorpar.training.tokenizer import train_byte_level_bpe

    root = tmp_path_factory.mktemp("hf")
    text = root / "text.txt"
    text.write_text(TEXT)
    tokenizer = train_byte_level_bpe([text], 300, root / "llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama")
    return root / "llama", text, tokenizer


def test_prepare_with_a_tokenizer_or_a_new_bpe(local_llama, tmp_path, capsys):
    model_dir, text, tokenizer = local_llama
    out = tmp_path / "tokens.bin"
    assert main(["prepare", str(text), "--tokenizer", str(model_dir), "--out", str(out)]) == 0
    meta = json.loads((tmp_path / "tokens.bin.json").read_text())
    assert meta["tokenizer"] == str(model_dir.resolve()) and meta["vocab_size"] == len(tokenizer)
    expected = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    from tensorpar.training.data import load_corpus

    assert load_corpus(out).tokens.tolist() == expected
    assert main(["prepare", str(text), "--tokenizer", str(model_dir), "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["prepare", str(text), "--bpe-vocab", "280", "--out", str(tmp_path / "bpe.bin")]) == 0
    assert (tmp_path / "bpe.bin.tokenizer" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "bpe.bin.json").read_text())["vocab_size"] == 280


def _cli(*argv) -> str:
    proc = run_tensorpar(argv)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_fine_tune_a_local_llama_end_to_end(local_llama, tmp_path):
    model_dir, text, _ = local_llama
    tokens, run, exported = tmp_path / "tokens.bin", tmp_path / "run", tmp_path / "exported"
    assert main(["prepare", str(text), "--tokenizer", str(model_dir), "--out", str(tokens)]) == 0
    assert main(["train", "--init-from-hf", str(model_dir), "--data", str(tokens), "--steps", "20", "--nproc", "2",
                 "--tp", "2", "--seq-len", "32", "--micro-batch", "4", "--eval-every", "10", "--lr", "3e-3",
                 "--warmup", "2", "--log-every", "1", "--no-progress", "--tensorboard", "--out", str(run)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert losses[-1] < losses[0] - 1.0, losses  # it learns the repetitive text
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    # Run in processes of their own: a one-process command joins a process group in its process.
    ours = _cli("generate", "--checkpoint", str(run), "--prompt", "the quick", "--max-new-tokens", "12",
                "--temperature", "0", "--nproc", "1", "--tp", "1").strip().splitlines()[-1]
    assert ours.startswith("the quick") and len(ours) > len("the quick")
    _cli("export", "--checkpoint", str(run), "--to-hf", str(exported))
    pipe = transformers.pipeline("text-generation", model=str(exported))
    theirs = pipe("the quick", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert theirs == ours


def _cli_in(cwd, *argv) -> subprocess.CompletedProcess:
    return run_tensorpar(argv, cwd=cwd)


SMALL = ["--steps", "2", "--nproc", "1", "--tp", "1", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len",
         "16", "--micro-batch", "2", "--warmup", "1", "--eval-every", "0", "--no-progress"]


@pytest.mark.slow
def test_the_tokenizer_travels_with_the_checkpoint_and_generate_takes_one(local_llama, tmp_path):
    """A tokenizer given as a relative path, then deleted: generate from another directory still
    decodes with the copy in the checkpoint. A token-file run without one takes --tokenizer."""
    _, text, tokenizer = local_llama
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    (tmp_path / "elsewhere").mkdir()
    trained = _cli_in(tmp_path, "train", "--data", str(text), "--tokenizer", "tok", *SMALL, "--out", "run")
    assert trained.returncode == 0, trained.stderr
    shutil.rmtree(tmp_path / "tok")
    assert json.loads((tmp_path / "run" / "step_2" / "meta.json").read_text())["tokenizer"] == "tokenizer"
    generated = _cli_in(tmp_path / "elsewhere", "generate", "--checkpoint", "../run", "--prompt", "the quick",
                        "--max-new-tokens", "4", "--nproc", "1", "--tp", "1")
    assert generated.returncode == 0 and generated.stdout.startswith("the quick"), generated.stderr

    from tensorpar.training.data import write_token_file

    write_token_file(tmp_path / "tokens.bin", torch.arange(5000) % len(tokenizer), vocab_size=len(tokenizer))
    assert _cli_in(tmp_path, "train", "--data", "tokens.bin", *SMALL, "--out", "ids").returncode == 0
    generate = ["generate", "--checkpoint", "ids", "--prompt", "the quick", "--max-new-tokens", "4", "--nproc", "1",
                "--tp", "1"]
    assert "is token ids separated by spaces" in _cli_in(tmp_path, *generate).stderr
    generated = _cli_in(tmp_path, *generate, "--tokenizer", str(tmp_path / "run" / "step_2" / "tokenizer"))
    assert generated.returncode == 0 and generated.stdout.startswith("the quick"), generated.stderr
