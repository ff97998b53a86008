"""What a person watching a run sees: a progress bar, ``metrics.jsonl`` and ``loss.png``, and
with ``tensorboard=True`` the same metrics as TensorBoard scalars in ``<out>/tensorboard``.

Only rank 0 reports. On a terminal a tqdm bar shows each step; when stderr is not a terminal
(a log file, a pipe, a batch system) every ``log_every``-th step is one plain line, with no
carriage-return redraws. tqdm and matplotlib are optional: without tqdm the plain lines are
used, without matplotlib there is no plot; either absence is noted once.

Crash safety: a ``metrics.jsonl`` row is appended with one ``write`` and cut back off if the
write fails (disk full), so the file only ever holds whole rows; ``loss.png`` and a rewritten
``metrics.jsonl`` are written to a temporary file and renamed over the old one. None of these
opens follows a symlink (see :func:`rundir.open_regular`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from .rundir import check_dir, open_regular

METRICS = "metrics.jsonl"
PLOT = "loss.png"
TENSORBOARD = "tensorboard"


def _note(message: str) -> None:
    print(f"tensorpar: {message}", file=sys.stderr, flush=True)


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
                 bar: bool = True, tensorboard: bool = False) -> None:
        """``bar``: a progress bar if stderr is a terminal (else plain lines at each logged step);
        ``tensorboard``: also write every metrics row through ``torch.utils.tensorboard``."""
        self.out, self.enabled, self.total_steps = out, enabled, total_steps
        self.rows: list[dict] = []
        self._bar = self._writer = None
        self._started = time.perf_counter()
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
        if bar and sys.stderr.isatty():
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

    def step(self, *, step: int, loss: float, lr: float, tokens_per_s: float, grad_norm: float,
             log: bool) -> None:
        """Advance the bar by one step; write a metrics row when ``log``."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self._bar.update(1)
        if log:
            self._append({"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s,
                          "grad_norm": grad_norm, "elapsed_s": round(time.perf_counter() - self._started, 3)})
            if self._bar is None:
                _note(f"step {step}/{self.total_steps} loss {loss:.4f} lr {lr:.2e} {tokens_per_s:,.0f} tokens/s")

    def eval(self, *, step: int, val_loss: float) -> None:
        if not self.enabled:
            return
        self._append({"step": step, "val_loss": val_loss})
        message = f"step {step} validation loss {val_loss:.4f}"
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            _note(message)
        self.plot()

    def plot(self) -> None:
        """Write ``loss.png`` (train and validation loss against step)."""
        if not self.enabled or self.out is None:
            return
        try:
            import matplotlib
        except ImportError:
            if not getattr(Progress, "_noted_plot", False):
                Progress._noted_plot = True
                _note("matplotlib is not installed: no loss.png")
            return
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        train = [(r["step"], r["loss"]) for r in self.rows if "loss" in r and math.isfinite(r["loss"])]
        val = [(r["step"], r["val_loss"]) for r in self.rows if "val_loss" in r]
        if not train and not val:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), label="train", linewidth=1)
        if val:
            ax.plot(*zip(*val), "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            replace_file(self.out / PLOT, lambda f: fig.savefig(f, dpi=100, format="png"))
        finally:
            plt.close(fig)

    def close(self) -> None:
        """Close the bar (the final plot is the caller's, on success: see :meth:`plot`)."""
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
