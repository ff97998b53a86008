"""What a run shows. metrics.jsonl and loss.png are never left half-written: a failed append
leaves the file as it was, a failed plot leaves the previous loss.png and no temporary file. On a
terminal a tqdm bar, elsewhere plain log lines (no carriage returns)."""

import errno
import io
import json
import os
import sys

import pytest

from tensorpar.training import progress
from tests.cli_runner import run_python_code


def _full_disk_after(nbytes, monkeypatch):
    """``os.write`` writes ``nbytes`` of the next buffer, then fails with ENOSPC."""
    real_write = os.write

    def write(fd, data):
        real_write(fd, data[:nbytes])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(progress.os, "write", write)


def test_a_failed_append_leaves_only_whole_rows(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    progress.append_line(metrics, json.dumps({"step": 1}) + "\n")
    before = metrics.read_bytes()
    _full_disk_after(5, monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        progress.append_line(metrics, json.dumps({"step": 2, "loss": 1.0}) + "\n")
    assert metrics.read_bytes() == before
    assert progress.read_rows(metrics) == [{"step": 1}]


def test_a_row_cut_off_by_a_power_loss_is_dropped_on_resume(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert progress.read_rows(metrics) == [{"step": 1, "loss": 2.0}]
    report = progress.Progress(out=tmp_path, total_steps=4, first_step=1, enabled=True, bar=False)
    assert report.rows == [{"step": 1, "loss": 2.0}]
    assert metrics.read_text() == '{"step": 1, "loss": 2.0}\n'


def test_a_failed_plot_keeps_the_previous_one_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    report = progress.Progress(out=tmp_path, total_steps=4, first_step=0, enabled=True, bar=False)
    report.step(step=1, loss=3.0, lr=1e-3, tokens_per_s=1.0, grad_norm=1.0, log=True)
    report.plot()
    previous = (tmp_path / "loss.png").read_bytes()

    def savefig(self, f, **kwargs):
        f.write(b"\x89PNG partial")
        raise OSError(errno.ENOSPC, "No space left on device", f.name)

    monkeypatch.setattr(Figure, "savefig", savefig)
    report.step(step=2, loss=2.0, lr=1e-3, tokens_per_s=1.0, grad_norm=1.0, log=True)
    with pytest.raises(OSError, match="No space left on device"):
        report.plot()
    assert (tmp_path / "loss.png").read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]


def _run(out, steps=6, log_every=2):
    report = progress.Progress(out=out, total_steps=steps, first_step=0, enabled=True, bar=True)
    for step in range(1, steps + 1):
        report.step(step=step, loss=1.0 / step, lr=1e-3, tokens_per_s=1000.0, grad_norm=0.5,
                    log=step % log_every == 0)
    report.close()


def test_not_a_terminal_gets_one_plain_line_per_logged_step(tmp_path, capsys):
    _run(tmp_path)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [line.split(" loss")[0] for line in err.splitlines()] == \
        ["tensorpar: step 2/6", "tensorpar: step 4/6", "tensorpar: step 6/6"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_progress_bar(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _run(tmp_path)
    shown = terminal.getvalue()
    assert "\r" in shown and "6/6" in shown and "tensorpar: step" not in shown


@pytest.mark.parametrize("name", ["metrics.jsonl", ".metrics.jsonl.tmp", ".loss.png.tmp", "tensorboard"])
def test_a_planted_symlink_is_refused_in_one_line_and_its_target_untouched(tmp_path, name):
    """A link under a name the run writes (metrics, their temporary files, the TensorBoard
    directory) is refused naming it, and the file it points to keeps its bytes."""
    from tensorpar.training.rundir import RunDirError

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(RunDirError) as refused:
        report = progress.Progress(out=out, total_steps=4, first_step=2, enabled=True, bar=False,
                                   tensorboard=name == "tensorboard")
        report.step(step=3, loss=1.0, lr=1e-3, tokens_per_s=1.0, grad_norm=1.0, log=True)
        report.plot()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{out / name} is a symlink")
    assert victim.read_text() == "precious\n"


def test_without_matplotlib_the_run_says_so_once_and_names_only_the_metrics(tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--nproc", "1", "--tp", "1", "--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "16",
            "--micro-batch", "2", "--steps", "2", "--eval-every", "1", "--no-progress", "--out", str(out)]
    # One process (--nproc 1 trains in it), where matplotlib cannot be imported.
    done = run_python_code("import sys\n"
                           "sys.modules['matplotlib'] = sys.modules['matplotlib.figure'] = None\n"
                           "from tensorpar.cli.main import main\n"
                           f"sys.exit(main({argv!r}))")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("matplotlib is not installed: no loss.png") == 1, done.stderr
    assert done.stdout.splitlines()[-1] == f"checkpoint {out / 'step_2'}; metrics in {out}"
    assert not (out / "loss.png").exists()
