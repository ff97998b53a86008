"""What a person watching a run sees: a progress bar, ``metrics.jsonl`` and ``loss.png``, with
``tensorboard=True`` the same metrics as TensorBoard scalars in ``<out>/tensorboard``, and with
``wandb_config`` a Weights & Biases run (``WANDB_MODE=offline`` keeps it on disk).

Only rank 0 reports. On a terminal a tqdm bar shows each step; when stderr is not a terminal
(a log file, a pipe, a batch system) each logged step is one plain line (:func:`metrics.format_line`:
loss, learning rate, grad norm, rates per device and MFU, peak memory, elapsed time and ETA),
with no carriage-return redraws. tqdm and matplotlib are optional: without tqdm the plain lines
are used, without matplotlib there is no plot; either absence is noted once.

Crash safety: a ``metrics.jsonl`` row is appended with one ``write`` and cut back off if the
write fails (disk full), so the file only ever holds whole rows; ``loss.png`` and a rewritten
``metrics.jsonl`` are written to a temporary file and renamed over the old one. None of these
opens follows a symlink (see :func:`rundir.open_regular`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

from ..errors import UsageError
from .metrics import Rates, format_line, peak_memory
from .rundir import check_dir, open_regular

METRICS = "metrics.jsonl"
PLOT = "loss.png"
TENSORBOARD = "tensorboard"


def _sized_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal of some width: on one that reports none (a serial
    console, a bare pseudo-terminal) a bar draws nothing, so the log lines are printed instead.
    A terminal with no file descriptor to ask (a wrapper) is taken at its word."""
    if not stream.isatty():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):
        return True


def _note(message: str) -> None:
    print(f"tensorpar: {message}", file=sys.stderr, flush=True)


def check_wandb(given: bool | None, meta: dict | None) -> None:
    """Refuse ``--wandb`` (``given``, or left out and the resumed run's, ``meta``) without wandb installed."""
    resumed = bool((meta or {}).get("settings", {}).get("wandb"))
    if (given or (given is None and resumed)) and importlib.util.find_spec("wandb") is None:
        how = "" if given else " (the resumed run logged to W&B: --no-wandb continues it without)"
        raise UsageError(f"--wandb needs the wandb package, which is not installed: pip install wandb{how}")


def append_line(path: Path, line: str) -> None:
    """Append ``line`` (one whole row) to ``path``; on failure the file is left as it was."""
    data = line.encode()
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except BaseException:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def replace_file(path: Path, write) -> None:
    """Write ``path`` through ``write(binary_file)`` and rename it into place; no partial file remains."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with os.fdopen(open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_rows(path: Path) -> list[dict]:
    """The whole rows of a ``metrics.jsonl`` (a last line cut off by a power loss is dropped)."""
    with os.fdopen(open_regular(path, os.O_RDONLY), encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]


class Progress:
    """Rank 0's reporter. ``out=None`` keeps rows in memory only; ``enabled=False`` does nothing.

    On resume (``first_step > 0``) rows of ``metrics.jsonl`` after ``first_step`` (left by the
    interrupted run) are dropped, so the file describes one continuous run.
    """

    def __init__(self, *, out: Path | None, total_steps: int, first_step: int, enabled: bool,
                 bar: bool = True, tensorboard: bool = False, rates: Rates | None = None, device=None,
                 wandb_config: dict | None = None, compiling: bool = False) -> None:
        """``bar``: a progress bar if stderr is a terminal (else plain lines at each logged step);
        ``tensorboard``: also write every metrics row through ``torch.utils.tensorboard``;
        ``rates``: the per-device rates and MFU of each row; ``device``: whose peak memory each row
        reports (None: the process's peak RSS); ``wandb_config``: the run's config, to start a
        Weights & Biases run with and log every row to (None: no W&B); ``compiling``: the first
        step compiles the model, so its row has no ETA (its rate would say minutes for seconds)."""
        self.out, self.enabled, self.total_steps, self.first_step = out, enabled, total_steps, first_step
        self.rates, self.device, self.compiling = rates, device, compiling
        self.rows: list[dict] = []
        self._plotted: tuple[list, list] | None = None  # the points loss.png shows
        self._bar = self._writer = self._wandb = None
        self._started = self._first_done = time.perf_counter()
        if not enabled:
            return
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            metrics = out / METRICS
            if first_step > 0 and os.path.lexists(metrics):
                self.rows = [row for row in read_rows(metrics) if row["step"] <= first_step]
            text = "".join(json.dumps(row) + "\n" for row in self.rows)
            replace_file(metrics, lambda f: f.write(text.encode()))
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                check_dir(out / TENSORBOARD)
                self._writer = SummaryWriter(str(out / TENSORBOARD), purge_step=first_step + 1 if first_step else None)
        if wandb_config is not None:
            import wandb  # the command checked that it is installed

            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "tensorpar"),
                                     name=out.name if out is not None else None,
                                     dir=str(out) if out is not None else None, config=wandb_config)
        if bar and _sized_terminal(sys.stderr):
            try:
                from tqdm import tqdm
            except ImportError:
                _note("tqdm is not installed: plain log lines instead of a progress bar")
            else:
                self._bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True,
                                 file=sys.stderr)

    def _append(self, row: dict) -> None:
        self.rows.append(row)
        if self.out is not None:
            append_line(self.out / METRICS, json.dumps(row) + "\n")
        if self._writer is not None:
            for name, value in row.items():
                if name != "step":
                    self._writer.add_scalar(name, value, row["step"])
        if self._wandb is not None:
            self._wandb.log({name: value for name, value in row.items() if name != "step"}, step=row["step"])

    def _eta(self, step: int, now: float) -> float | None:
        """Seconds left at the rate since this run's first step (whose warm-up, a compilation
        included, would skew it); after only that step, at its rate, unless it compiled (None)."""
        if step == self.first_step + 1:
            return None if self.compiling else (now - self._started) * (self.total_steps - step)
        return (now - self._first_done) / (step - self.first_step - 1) * (self.total_steps - step)

    def step(self, *, step: int, loss: float, lr: float, tokens_per_s: float, grad_norm: float,
             log: bool, extra: dict | None = None) -> None:
        """Advance the bar by one step; write a metrics row (with ``extra``'s fields) when ``log``."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self._bar.update(1)
        if step == self.first_step + 1:
            self._first_done = now
        if log:
            rates = self.rates.fields(tokens_per_s=tokens_per_s) if self.rates is not None else {}
            row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, **(extra or {}),
                   "tokens_per_s": tokens_per_s, **rates, **peak_memory(self.device), "elapsed_s": round(now - self._started, 3)}
            eta = self._eta(step, now)
            if eta is not None:
                row["eta_s"] = round(eta, 1)
            self._append(row)
            if self._bar is None:
                _note(format_line(row, total_steps=self.total_steps))

    def eval(self, *, step: int, val_loss: float) -> None:
        if not self.enabled:
            return
        self._append({"step": step, "val_loss": val_loss})
        self.say(f"step {step} validation loss {val_loss:.4f}")
        self.plot()

    def say(self, message: str) -> None:
        """One line of news (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            _note(message)

    def plot(self) -> None:
        """Write ``loss.png`` (train and validation loss against step)."""
        if not self.enabled or self.out is None:
            return
        try:
            from matplotlib.figure import Figure
        except ImportError:
            if not getattr(Progress, "_noted_plot", False):
                Progress._noted_plot = True
                _note("matplotlib is not installed: no loss.png")
            return
        train = [(r["step"], r["loss"]) for r in self.rows if "loss" in r and math.isfinite(r["loss"])]
        val = [(r["step"], r["val_loss"]) for r in self.rows if "val_loss" in r]
        if (not train and not val) or (train, val) == self._plotted:
            return
        # A Figure without pyplot (no global figure manager); fixed margins instead of tight_layout,
        # which measured every tick label and took half the plot's time.
        fig = Figure(figsize=(7, 4))
        fig.subplots_adjust(left=0.11, right=0.98, bottom=0.12, top=0.97)
        ax = fig.subplots()
        if train:
            ax.plot(*zip(*train), label="train", linewidth=1)
        if val:
            ax.plot(*zip(*val), "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        replace_file(self.out / PLOT, lambda f: fig.savefig(f, dpi=100, format="png"))
        self._plotted = (train, val)

    def close(self) -> None:
        """Close the bar (the final plot is the caller's, on success: see :meth:`plot`)."""
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
