"""Every command in README.md and the docs/ pages runs, page after page in PAGES order, in one
directory: the fenced ``bash`` blocks (shortened by the flags in SHORTER) must succeed, and each
``$ command`` transcript must print what the page shows (a line ``...`` there stands for lines
left out). A command this test does not know fails it: run it here, or list it in NOT_RUN with
the reason. Every docs page is listed in PAGES and linked from the README, every relative link
resolves, and docs/api.md is what the docstrings generate.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runner import run_python_code, run_tensorpar

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose commands run, in this order (later pages use what earlier ones wrote).
PAGES = ("README.md", "docs/training.md", "docs/checkpoints.md", "docs/huggingface.md", "docs/library.md",
         "docs/invariant.md", "docs/porting-from-megatron.md", "docs/fsdp.md", "docs/pipeline.md", "docs/context.md",
         "docs/context-parallel.md", "docs/experts.md", "docs/communication-model.md",
         "docs/benchmarks.md", "docs/multi-node-and-gpus.md", "docs/troubleshooting.md", "docs/architecture.md")
# Pages with no commands of their own to run.
GENERATED = {"docs/api.md": "generated from the docstrings; test_api_reference_is_current checks it"}

# Commands (by their first words) that this test does not run, and why.
NOT_RUN = {
    "pip install": "installs packages; .ci/run runs the install line on a clean machine",
    "python -m pytest": "the test suite itself; .ci/run runs it",
    "tensorboard --logdir": "starts a server; the fine-tune run's --tensorboard files are checked instead",
    "torchrun": "two nodes; test_training_cli.py::test_two_torchrun_nodes_on_localhost_train_together runs two "
                "torchrun launchers on one machine",
    "python -m tensorpar.cli.gpu_check": "needs CUDA; test_gpu_check.py runs the same checks with --cpu",
    "tensorpar train --nproc 4 --tp 1 --pp 2 --cp 2": "4 ranks, seconds of the suite's budget; "
                                                      "test_training_pipeline_context.py trains PP 2 x CP 2",
}

TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "16", "--micro-batch", "2",
        "--eval-iters", "1", "--log-every", "100"]
# Flags appended to a command (argparse keeps a flag's last value), by the command as the page
# writes it, so that every page runs in about a minute on two cores. The quick start keeps its
# 600 steps (the transcripts name the step) on a tiny model; the rest run a few steps on one or
# two processes (generate runs a small model in one by itself). Every key must be a command of a page.
SHORTER = {
    "tensorpar train": [*TINY, "--nproc", "1"],
    "tensorpar generate --checkpoint tensorpar-run --prompt 'def '": ["--max-new-tokens", "8"],
    "tensorpar train --resume tensorpar-run --steps 1000 --nproc 4 --tp 4": ["--steps", "610", "--nproc", "2",
                                                                             "--tp", "2"],
    "tensorpar train --init-from-hf my-llama --data notes.bin --nproc 2 --tp 2 --steps 200 --lr 3e-5 --seq-len 512 "
    "--tensorboard --out ft-run": ["--steps", "2", "--seq-len", "16", "--micro-batch", "2", "--eval-iters", "1"],
    "tensorpar generate --checkpoint ft-run --prompt 'Once upon' --temperature 0": ["--max-new-tokens", "8"],
    "tensorpar train --nproc 2 --tp 1 --cp 2 --cp-comm a2a --steps 20 --out cp-run": [*TINY, "--steps", "2"],
    "tensorpar train --model moe-tiny --nproc 2 --tp 1 --ep 2 --steps 20 --out moe-run": [*TINY, "--steps", "2"],
    "tensorpar train --model moe-tiny --nproc 2 --tp 1 --ep 2 --tp-invariant --steps 20 --out moe-invariant":
        [*TINY, "--steps", "2"],
    "tensorpar train --resume cp-run --cp 1 --nproc 1 --tp 1 --steps 40": [*TINY, "--steps", "3"],
    "tensorpar train --nproc 4 --tp 1 --cp 4 --cp-comm a2a --heads 2 --hidden 32": [],  # refused as written
    "tensorpar train --lr 1e30": [*TINY, "--log-every", "2"],  # the loss is read back at logged steps
}
# Transcripts of a new run: run in an empty directory (the README's own would hold the quick start's run).
IN_EMPTY_DIR = {"tensorpar train --lr 1e30"}
# What a command promises to write.
WRITES = {
    "tensorpar train": ["tensorpar-run/metrics.jsonl", "tensorpar-run/loss.png", "tensorpar-run/step_600",
                        "tensorpar-run/latest"],
    "tensorpar export --checkpoint tensorpar-run --to-hf gpt2-out": ["gpt2-out/config.json",
                                                                     "gpt2-out/model.safetensors"],
    "tensorpar prepare notes.txt --tokenizer my-llama --out notes.bin": ["notes.bin", "notes.bin.json"],
    "tensorpar export --checkpoint ft-run --to-hf ft-hf": ["ft-hf/config.json", "ft-hf/tokenizer.json"],
}


def _commands(block: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, ``&&`` split."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1:]
    return commands


def _transcripts(block: str) -> list[tuple[list[str], list[str]]]:
    """``$ command`` lines of a block and the output lines after each."""
    pairs = []
    for line in block.splitlines():
        if line.startswith("$ "):
            pairs.append((shlex.split(line[2:]), []))
        elif pairs:
            pairs[-1][1].append(line.rstrip())
    return pairs


def page_steps() -> list[tuple[str, list[str], list[str] | None]]:
    """("run", command, None), ("transcript", command, expected output) or ("write", [file], lines)
    of every page, in PAGES order: a ``toml`` block whose first line is ``# NAME.toml`` is a file
    the commands after it read."""
    steps = []
    for page in PAGES:
        for language, block in re.findall(r"^```(\w*)\n(.*?)^```", (ROOT / page).read_text(), flags=re.M | re.S):
            if language == "bash":
                steps += [("run", words, None) for words in _commands(block)]
            elif language == "toml" and (named := re.match(r"# (\S+\.toml)", block)):
                steps.append(("write", [named[1]], block.splitlines()))  # the file the next commands read
            elif block.startswith("$ "):
                steps += [("transcript", words, expected) for words, expected in _transcripts(block)]
    return steps


def _not_run(words: list[str]) -> str | None:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    return next((why for start, why in NOT_RUN.items() if words[:len(start.split())] == start.split()), None)


def _normalized(text: str) -> str:
    """Output as compared: trailing blanks dropped; which rank fails first is a race."""
    text = "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")
    return re.sub(r"\(rank \d+\)", "(rank N)", text)


def _shows(expected: list[str], output: str) -> bool:
    """Whether ``output`` is what a transcript shows; a line ``...`` there stands for one or more lines."""
    pattern = "\n".join(r".*(?:\n.*)*" if line == "..." else re.escape(line)
                        for line in _normalized("\n".join(expected)).splitlines())
    return re.fullmatch(pattern, _normalized(output)) is not None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, local_llama):
    """The directory the pages' commands run in, with what they name: my-llama and notes.txt."""
    model_dir, text, _ = local_llama
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(model_dir, root / "my-llama")
    shutil.copy(text, root / "notes.txt")
    return root


from tests.test_training_tokenizer import local_llama  # noqa: E402,F401 - the fixture


def test_every_docs_page_is_listed_linked_from_the_readme_and_its_links_resolve():
    pages = {f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")}
    assert pages == set(PAGES[1:]) | set(GENERATED), sorted(pages ^ (set(PAGES[1:]) | set(GENERATED)))
    readme = README.read_text()
    assert all(f"]({page})" in readme for page in pages), sorted(p for p in pages if f"]({p})" not in readme)
    for page in [*PAGES, *GENERATED]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (ROOT / page).read_text()):
            assert ((ROOT / page).parent / target).exists(), (page, target)


def test_api_reference_is_current():
    done = subprocess.run([sys.executable, "-m", "tensorpar.cli.api_reference"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr
    assert done.stdout == (ROOT / "docs/api.md").read_text(), \
        "docs/api.md is stale: python -m tensorpar.cli.api_reference > docs/api.md"


@pytest.mark.slow
def test_every_command_of_the_pages_runs_and_prints_what_the_page_shows(workdir):
    steps = page_steps()
    written = {shlex.join(words) for _, words, _ in steps}
    assert set(SHORTER) <= written and set(WRITES) <= written and IN_EMPTY_DIR <= written, \
        sorted((set(SHORTER) | set(WRITES) | IN_EMPTY_DIR) - written)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    ran = []
    for kind, words, expected in steps:
        if kind == "write":
            (workdir / words[0]).write_text("\n".join(expected) + "\n")
            continue
        if _not_run(words):
            continue
        command = shlex.join(words)
        cwd = workdir / "empty" if command in IN_EMPTY_DIR else workdir
        cwd.mkdir(exist_ok=True)
        if words[0] == "tensorpar":
            done = run_tensorpar([*words[1:], *SHORTER.get(command, [])], cwd=cwd, env=env)
        elif words[:2] == ["python", "-c"] and len(words) == 3:
            done = run_python_code(words[2], cwd=cwd, env=env)
        else:
            pytest.fail(f"command {command!r}: run it in this test, or list it in NOT_RUN with the reason")
        ran.append(command)
        if kind == "run":
            assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        else:
            shown = done.stdout if done.returncode == 0 else done.stderr
            assert _shows(expected, shown), (command, done.stdout, done.stderr)
        for path in WRITES.get(command, []):
            assert (workdir / path).exists(), (command, path)
    assert (workdir / "ft-run" / "tensorboard").is_dir()
    assert len(ran) >= 14, ran
