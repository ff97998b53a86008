"""A fault ends the job fast with its cause and loses nothing; preemption (SIGTERM) saves and
resumes bit-identically; Ctrl-C (SIGINT) stops without a traceback, naming the last checkpoint."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorpar.training import checkpoint_files
from tensorpar.cli.training_cli import parse_train_args
from tests.cli_runner import fault_env
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--warmup", "1", "--eval-every", "0", "--no-progress", "--tp", "1", "--seed", "3"]


def _cli(*argv, fault=None, stamp=None):
    env = fault_env(fault, TENSORPAR_FAULT_STAMP=str(stamp)) if fault else dict(os.environ)
    return subprocess.Popen([sys.executable, "-m", "tensorpar", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _finish(proc, timeout=180):
    """Wait for the command; returns (stdout, stderr, when its last process was gone)."""
    out, err = proc.communicate(timeout=timeout)
    deadline = time.monotonic() + 5  # multiprocessing's resource tracker exits just after
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return out, err, time.time()
        assert time.monotonic() < deadline, "a process of the job outlived the command"
        time.sleep(0.05)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("fault, cause", [
    ("batch:1:3", "ValueError: bad batch at step 3 (rank 1)"),
    ("metrics-enospc:0:3", "OSError: [Errno 28] No space left on device: '{out}/metrics.jsonl' (rank 0)"),
])
@pytest.mark.slow
def test_a_rank_that_raises_mid_step_ends_every_rank_within_10s_with_the_cause(tmp_path, fault, cause):
    out, stamp = tmp_path / "run", tmp_path / "fault-time"
    proc = _cli("train", "--nproc", "2", *TINY, "--steps", "6", "--save-every", "2", "--log-every", "1",
                "--out", str(out), fault=fault, stamp=stamp)
    error_line = f"tensorpar train: error: {cause.format(out=out)}"
    reported, lines = None, []
    for line in proc.stderr:  # the launcher reports once every rank has exited
        lines.append(line)
        if line.rstrip("\n") == error_line:
            reported = time.time()
    _finish(proc)
    assert proc.returncode == 1
    assert reported is not None, "".join(lines)
    assert reported - float(stamp.read_text()) < 10  # not the 300 s collective timeout
    assert (out / "latest").read_text() == "step_2\n"  # nothing lost
    assert [row["step"] for row in _rows(out)] == [1, 2]  # whole rows only
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


@pytest.fixture
def tmpfs(tmp_path):
    """A 1.2 MB filesystem: room for one tiny checkpoint, not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("this machine cannot mount a tmpfs (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.slow
def test_disk_full_on_a_small_tmpfs(tmpfs):
    out = tmpfs / "run"
    began = time.time()
    proc = _cli("train", "--nproc", "2", *TINY, "--steps", "8", "--save-every", "2", "--out", str(out))
    _, err, ended = _finish(proc)
    assert proc.returncode != 0
    assert "No space left on device" in err and "saving checkpoint step 4" in err, err
    assert ended - began < 100, err  # a 300 s collective timeout would show
    assert sorted(p.name for p in out.iterdir()) == [".tensorpar.lock", "config.toml", "latest", "metrics.jsonl",
                                                    "step_2"]
    checkpoint_files.verify(out / "step_2")


def _signal_body(argv, signum, at_step, ranks):
    """Train, sending ``signum`` to this process while it runs step ``at_step`` on ``ranks``;
    returns (losses, checkpoint, stopped_by, exit code, what this rank printed)."""
    import torch.distributed as dist

    from tensorpar.training import loop
    from tensorpar.training.data import BatchSampler

    real_batches = BatchSampler.micro_batches

    def micro_batches(self, index):
        if index == at_step - 1 and dist.get_rank() in ranks and self.stream == 0:
            os.kill(os.getpid(), signum)
        return real_batches(self, index)

    BatchSampler.micro_batches = micro_batches
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            result = loop.train(parse_train_args(argv))
        return result.losses, result.checkpoint, result.stopped_by, None, said.getvalue()
    except KeyboardInterrupt as exc:
        return None, None, None, type(exc).__name__, said.getvalue()
    finally:
        BatchSampler.micro_batches = real_batches
        signal.signal(signal.SIGINT, signal.default_int_handler)  # an interrupted run leaves it ignored


def _full(tmp_path, world, *extra):
    argv = TINY + ["--steps", "8", "--out", str(tmp_path / "full"), *extra]
    return run_on_ranks(_signal_body, world, argv, signal.SIGTERM, -1, ())[0][0]


def test_sigterm_on_one_rank_saves_after_the_step_and_resume_is_bit_identical(tmp_path):
    full = _full(tmp_path, 2, "--tp", "2")
    out = tmp_path / "run"
    argv = TINY + ["--tp", "2", "--steps", "8", "--save-every", "5", "--out", str(out)]
    results = run_on_ranks(_signal_body, 2, argv, signal.SIGTERM, 3, (1,))
    losses, ckpt, stopped_by, code, said = results[0]
    assert [r[:4] for r in results] == [(losses, ckpt, "SIGTERM", None)] * 2  # the ranks agree
    assert list(losses) == [1, 2, 3] and ckpt == str(out / "step_3")
    assert (f"tensorpar train: stopped by SIGTERM after step 3; checkpoint {out}/step_3 (continue with "
            f"--resume {out})") in said.splitlines()
    resumed = run_on_ranks(_signal_body, 2, argv + ["--resume", str(out)], signal.SIGTERM, -1, ())[0][0]
    assert {**losses, **resumed} == full  # bit-identical, not approximately


def test_sigint_stops_at_once_naming_the_last_checkpoint_and_resume_is_bit_identical(tmp_path):
    full = _full(tmp_path, 2)
    out = tmp_path / "run"
    argv = TINY + ["--steps", "8", "--save-every", "2", "--out", str(out)]
    results = run_on_ranks(_signal_body, 2, argv, signal.SIGINT, 5, (0, 1))
    # Every rank stops at once and says nothing beyond its step logs: the command says it, once (cli/errors.py).
    assert [r[3] for r in results] == ["KeyboardInterrupt"] * 2
    assert [[line for line in r[4].splitlines() if not line.startswith("tensorpar: step ")] for r in results] == [[]] * 2
    assert checkpoint_files.resume_hint(out) == f"the last checkpoint is {out}/step_4 (continue with --resume {out})"
    resumed = run_on_ranks(_signal_body, 2, argv + ["--resume", str(out)], signal.SIGINT, -1, ())[0][0]
    assert list(resumed) == [5, 6, 7, 8]
    assert resumed == {step: full[step] for step in resumed}


def _wait_for_step(proc, out, step, timeout=120):
    deadline = time.monotonic() + timeout
    while not ((out / "metrics.jsonl").is_file() and len(_rows(out)) >= step):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)


@pytest.mark.slow
def test_ctrl_c_on_the_command_prints_one_line_and_no_traceback(tmp_path):
    out = tmp_path / "run"
    proc = _cli("train", "--nproc", "1", *TINY, "--steps", "100000", "--save-every", "2", "--log-every", "1",
                "--out", str(out))
    _wait_for_step(proc, out, 3)
    os.killpg(proc.pid, signal.SIGINT)
    _, err, _ = _finish(proc)
    assert proc.returncode == 130
    assert "Traceback" not in err
    last = (out / "latest").read_text().strip()
    assert err.strip().splitlines()[-1] == (f"tensorpar train: interrupted (SIGINT); the last checkpoint is "
                                            f"{out}/{last} (continue with --resume {out})")


def _drain(fd) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


@pytest.mark.slow
@pytest.mark.parametrize("moment, flags, fault", [
    ("before any checkpoint", ["--save-every", "0"], "mark:1:3"),
    ("after a save", ["--save-every", "2"], "mark:0:4"),
    ("during a save", ["--save-every", "2"], "slow-save:0:4"),
])
@pytest.mark.slow
def test_ctrl_c_on_a_2_process_run_prints_exactly_one_line(tmp_path, moment, flags, fault):
    """As a terminal does: SIGINT to the whole process group (the launcher and both ranks), at
    ``moment``; everything printed after it is the one line, and the command exits 130."""
    out, stamp = tmp_path / "run", tmp_path / "stamp"
    env = fault_env(fault, TENSORPAR_FAULT_STAMP=str(stamp), PYTHONUNBUFFERED="1")
    # No log lines while it trains (--log-every): whatever it prints after the signal is its answer to it.
    proc = subprocess.Popen([sys.executable, "-m", "tensorpar", "train", "--nproc", "2", *TINY, "--steps", "100000",
                             "--log-every", "100000", *flags, "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    os.set_blocking(proc.stdout.fileno(), False)
    before, deadline = b"", time.monotonic() + 120
    while not stamp.exists():
        before += _drain(proc.stdout.fileno())
        assert proc.poll() is None and time.monotonic() < deadline, before.decode()
        time.sleep(0.05)
    time.sleep(0.3)  # into the step (or the save's pause)
    before += _drain(proc.stdout.fileno())
    os.killpg(proc.pid, signal.SIGINT)
    os.set_blocking(proc.stdout.fileno(), True)
    after, _, _ = _finish(proc)
    hint = "no checkpoint was written"
    if "save" in moment:
        last = (out / "latest").read_text().strip()
        assert last == "step_2" or moment == "after a save"  # the paused save never became latest
        checkpoint_files.verify(out / last)
        hint = f"the last checkpoint is {out}/{last} (continue with --resume {out})"
    assert after.decode() == f"tensorpar train: interrupted (SIGINT); {hint}\n", (moment, before.decode())
    assert proc.returncode == 130
    assert "Traceback" not in before.decode()


def _children(pid) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _workers(pid):
    """The rank processes a ``--nproc`` launcher started: the children of the server they fork from
    (not multiprocessing's resource tracker)."""
    workers = []
    for child in _children(pid):
        command = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"forkserver" in command:
            workers += _children(child)
        elif b"resource_tracker" not in command:
            workers.append(child)
    return workers


@pytest.mark.slow
def test_sigterm_to_the_ranks_checkpoints_says_where_and_exits_0(tmp_path):
    """What torchrun does when it is told to stop: it sends SIGTERM to every rank."""
    out = tmp_path / "run"
    proc = _cli("train", "--nproc", "2", *TINY, "--steps", "100000", "--log-every", "1", "--out", str(out))
    _wait_for_step(proc, out, 3)
    workers = _workers(proc.pid)
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    _, err, _ = _finish(proc)
    assert proc.returncode == 0, err
    _assert_saved_on_sigterm(out, err)


def _assert_saved_on_sigterm(out, err):
    """Rank 0 said where it saved, after step 3 or later; the checkpoint is whole; no traceback."""
    step = int((out / "latest").read_text().strip().removeprefix("step_"))
    assert step >= 3 and "Traceback" not in err
    assert (f"tensorpar train: stopped by SIGTERM after step {step}; checkpoint {out}/step_{step} "
            f"(continue with --resume {out})") in err.splitlines(), err
    checkpoint_files.verify(out / f"step_{step}")


@pytest.mark.slow
def test_sigterm_to_the_whole_job_checkpoints_and_ends_every_process_well_before_30s(tmp_path):
    """What Slurm's scancel and ``kill -- -PGID`` do: SIGTERM to the launcher and the ranks at once.
    The launcher's torch elastic agent then waits up to 30 s for its ranks and kills them; ranks
    that had saved and returned used to wait for the closing launcher to read their results."""
    out = tmp_path / "run"
    proc = _cli("train", "--nproc", "2", *TINY, "--steps", "100000", "--log-every", "1", "--out", str(out))
    _wait_for_step(proc, out, 3)
    sent = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    _, err, gone = _finish(proc)
    assert gone - sent < 25, err
    _assert_saved_on_sigterm(out, err)
