"""The training command as a user runs it, on the device it picks (a GPU when one is visible):
:mod:`tensorpar.cli.gpu_check`'s ``train`` stage.

A bf16 run of the default model, saved, evaluated and resumed; a completion from its checkpoint;
its export to a ``transformers`` directory (skipped, saying so, without transformers or
safetensors); and the invariant mode run twice, which must log the same losses. Each command
runs in this process (``--nproc 1`` trains in the process that starts it) with its output
captured; a command that fails raises with its status and last lines.

Example::

    check_training_command(Path("work"), steps=20, model=SMALL)
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

from ..training.progress import METRICS, read_rows

# The model and batch of ``gpu_check --cpu`` (and the test suite): seconds on a CPU.
SMALL = ("--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--micro-batch", "2")


def _tensorpar(*argv: str) -> str:
    """``tensorpar ARGV`` here; what it printed."""
    from .main import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        status = main(list(argv))
    if status != 0:
        tail = " | ".join(printed.getvalue().strip().splitlines()[-3:])
        raise RuntimeError(f"tensorpar {' '.join(argv)} exited {status}: {tail}")
    return printed.getvalue()


def _losses(run: Path) -> list[float]:
    return [row["loss"] for row in read_rows(run / METRICS) if "loss" in row]


def check_training_command(workdir: Path, *, steps: int, model: tuple[str, ...] = ()) -> dict:
    """Train ``steps`` steps, resume to ``2 x steps``, generate, export, and train the invariant
    mode twice, in ``workdir``; ``model``: flags of the model and batch (default: the command's).
    ``ok`` is whether the two invariant runs logged the same losses."""
    logs = ["--no-progress", "--log-every", str(steps), "--eval-iters", "2"]
    train = ["train", "--nproc", "1", "--dtype", "bf16", *model, "--steps", str(steps), *logs]
    run = workdir / "run"
    _tensorpar(*train, "--out", str(run))
    _tensorpar("train", "--nproc", "1", "--resume", str(run), "--steps", str(2 * steps), *logs)
    text = _tensorpar("generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "8")
    losses = _losses(run)
    result = {"loss": [losses[0], losses[-1]], "generated": text.rstrip("\n")}
    missing = [name for name in ("transformers", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        result["export"] = f"skipped: {' and '.join(missing)} not installed"
    else:
        _tensorpar("export", "--checkpoint", str(run), "--to-hf", str(workdir / "hf"))
        result["export"] = sorted(path.name for path in (workdir / "hf").iterdir())
    invariant = []
    for name in ("invariant_1", "invariant_2"):
        _tensorpar(*train, "--tp-invariant", "--save-every", "0", "--out", str(workdir / name))
        invariant.append(_losses(workdir / name))
    result["invariant_losses"] = invariant[0]
    result["ok"] = invariant[0] == invariant[1]
    return result
