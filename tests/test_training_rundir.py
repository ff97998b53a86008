"""One run per output directory: the OS lock (refusals name the holder's PID, released on
kill -9), no fresh run into a directory holding one, ``--overwrite`` loses nothing early."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tensorpar.training import rundir
from tensorpar.cli.training_cli import parse_train_args
from tests.cli_runner import fault_env
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--warmup", "1", "--eval-every", "0", "--no-progress", "--tp", "1"]

_HOLD = """
import sys, time
from tensorpar.training.rundir import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(300)
"""


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock on ``tmp_path / 'run'``."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield out, proc
    proc.kill()
    proc.wait()


def test_a_locked_directory_is_refused_naming_the_pid_and_freed_by_kill_9(holder):
    out, proc = holder
    with pytest.raises(rundir.RunDirError, match=rf"^--out {out} is in use by another tensorpar run "
                                                 rf"\(PID {proc.pid}\); wait for it to finish"):
        rundir.RunLock(out).acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rundir.RunLock(out).acquire().release()


def _train_or_refuse_body(argv):
    from tensorpar.training.loop import train

    try:
        return sorted(train(parse_train_args(argv)).losses)
    except rundir.RunDirError as exc:
        return str(exc)


def test_every_rank_refuses_a_locked_directory(holder):
    out, proc = holder
    refusals = run_on_ranks(_train_or_refuse_body, 2, TINY + ["--steps", "2", "--out", str(out)])
    assert refusals == [f"--out {out} is in use by another tensorpar run (PID {proc.pid}); wait for it to "
                        "finish or choose another --out"] * 2
    assert sorted(p.name for p in out.iterdir()) == [".tensorpar.lock"]


def test_torchrun_ranks_leave_the_directory_check_to_rank_0s_lock(tmp_path, monkeypatch):
    """Under torchrun (two nodes sharing --out) every rank checks its flags while rank 0 already
    holds the lock and writes the run: that must not refuse the run on the other ranks."""
    from tensorpar.cli.training_cli import _check_train_args

    out = tmp_path / "run"
    lock = rundir.RunLock(out).acquire()          # rank 0, already training
    (out / "metrics.jsonl").write_text("")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    try:
        args = parse_train_args(TINY + ["--tp", "2", "--out", str(out)])
        _check_train_args(args, world=2, print_config=False)
    finally:
        lock.release()


def _cli(*argv, env=None, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "tensorpar", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


@pytest.mark.slow
def test_two_concurrent_runs_on_one_directory(tmp_path):
    out = tmp_path / "run"
    # The first run holds the directory while its save of step 2 sleeps (tests/faults): the
    # second meets a live run without the first taking a core from the rest of the suite.
    first = _cli("train", "--nproc", "1", *TINY, "--steps", "3", "--save-every", "1", "--log-every", "1",
                 "--out", str(out), env=fault_env("slow-save:0:2"))
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        began = time.monotonic()
        second = _cli("train", "--nproc", "1", *TINY, "--steps", "2", "--out", str(out))
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2
        assert err.strip().splitlines()[-1] == (f"tensorpar train: error: --out {out} is in use by another "
                                                f"tensorpar run (PID {first.pid}); wait for it to finish or "
                                                "choose another --out")
        assert time.monotonic() - began < 60  # refused before any training starts
        assert first.poll() is None  # the first run goes on, untouched
    finally:
        first.kill()
        first.communicate()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))  # one run's rows only
    rundir.check(out, resume=True, overwrite=False)  # kill -9 released the lock


@pytest.fixture
def finished_run(tmp_path):
    out = tmp_path / "run"
    run_on_ranks(_train_or_refuse_body, 1, TINY + ["--steps", "2", "--out", str(out)])
    return out


def test_a_fresh_run_into_a_directory_holding_a_run_is_refused(finished_run):
    out = finished_run
    message = (f"--out {out} already holds a run (latest, loss.png, metrics.jsonl, step_2); continue it "
               f"with --resume {out} or start over with --overwrite")
    with pytest.raises(rundir.RunDirError) as refused:
        rundir.check(out, resume=False, overwrite=False)
    assert str(refused.value) == message
    assert run_on_ranks(_train_or_refuse_body, 1, TINY + ["--steps", "4", "--out", str(out)]) == [message]
    assert (out / "latest").read_text() == "step_2\n"
    with pytest.raises(rundir.RunDirError, match="give one of them"):
        rundir.check(out, resume=True, overwrite=True)


def _overwrite_body(argv, fail_at_step):
    """Train with --overwrite, recording what is on disk when the first checkpoint is saved."""
    from tensorpar.training import checkpoint, loop

    real_save, seen = checkpoint.save, []

    def save(out, step, **kwargs):
        seen.append(sorted(p.name for p in out.iterdir()))
        return real_save(out, step, **kwargs)

    def boom(*args, **kwargs):
        raise ValueError("bad batch")

    checkpoint.save = save
    if fail_at_step:
        loop.BatchSampler.micro_batches, real_batches = boom, loop.BatchSampler.micro_batches
    try:
        loop.train(parse_train_args(argv))
    except ValueError as exc:
        return str(exc), seen
    finally:
        checkpoint.save = real_save
        if fail_at_step:
            loop.BatchSampler.micro_batches = real_batches
    return None, seen


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(finished_run):
    out = finished_run
    old_step = (out / "step_2" / "manifest.json").read_text()
    argv = TINY + ["--steps", "4", "--save-every", "4", "--seed", "5", "--out", str(out), "--overwrite"]
    # A new run that fails before its first checkpoint loses nothing: the old run is set aside.
    assert run_on_ranks(_overwrite_body, 1, argv, True) == [("bad batch", [])]
    aside = out / ".previous-run-0"
    assert (aside / "step_2" / "manifest.json").read_text() == old_step
    assert (aside / "latest").read_text() == "step_2\n"
    # A new run that writes its first checkpoint: the old one existed until then, and is gone after.
    error, seen = run_on_ranks(_overwrite_body, 1, argv, False)[0]
    assert error is None and seen == [[".previous-run-0", ".previous-run-1", ".tensorpar.lock", "metrics.jsonl"]]
    assert sorted(p.name for p in out.iterdir()) == [".tensorpar.lock", "latest", "loss.png", "metrics.jsonl",
                                                     "step_4"]
    assert (out / "latest").read_text() == "step_4\n"


def test_a_run_that_holds_the_lock_releases_it_when_it_ends(finished_run):
    rundir.RunLock(finished_run).acquire().release()
    assert os.path.isfile(finished_run / rundir.LOCK)


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return victim


def _one_line_refusal(call, path):
    with pytest.raises(rundir.RunDirError) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path} is a symlink"), message
    return message


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    victim, out = _victim(tmp_path), tmp_path / "run"
    out.mkdir()
    (out / rundir.LOCK).symlink_to(victim)
    _one_line_refusal(lambda: rundir.RunLock(out).acquire(), out / rundir.LOCK)
    _one_line_refusal(lambda: rundir.check(out, resume=False, overwrite=False), out / rundir.LOCK)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["latest", "latest.tmp", "metrics.jsonl", ".loss.png.tmp", "tensorboard",
                                  "step_3", "step_4.tmp"])
def test_a_symlink_under_a_name_the_run_writes_is_refused_before_it_starts(tmp_path, name):
    victim, out = _victim(tmp_path), tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    _one_line_refusal(lambda: rundir.check(out, resume=True, overwrite=False), out / name)
    assert victim.read_text() == "precious\n"


def test_write_file_never_follows_a_link(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "latest.tmp").symlink_to(victim)
    _one_line_refusal(lambda: rundir.write_file(tmp_path / "latest.tmp", b"step_9\n"), tmp_path / "latest.tmp")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(rundir.RunDirError, match="fifo is not a regular file"):
        rundir.write_file(tmp_path / "fifo", b"x")
    assert victim.read_text() == "precious\n"


def test_a_file_system_without_flock_falls_back_to_lockf_else_warns_once(tmp_path, monkeypatch, capsys):
    import errno

    def unsupported(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(rundir.fcntl, "flock", unsupported)
    lock = rundir.RunLock(tmp_path / "run").acquire()
    assert (tmp_path / "run" / rundir.LOCK).read_text() == f"{os.getpid()}\n"
    lock.release()
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(rundir.fcntl, "lockf", unsupported)
    rundir.RunLock(tmp_path / "run").acquire().release()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot lock .tensorpar.lock (flock: Function not implemented; lockf: " \
        "Function not implemented); continuing unlocked" in err


def test_resuming_an_older_checkpoint_never_silently_replaces_newer_ones(tmp_path, capsys):
    out = tmp_path / "run"
    run_on_ranks(_train_or_refuse_body, 1, TINY + ["--steps", "4", "--save-every", "2", "--out", str(out)])
    newer = (out / "step_4" / "manifest.json").read_text()
    argv = TINY + ["--steps", "3", "--resume", str(out / "step_2"), "--out", str(out)]
    message = (f"--out {out} holds checkpoints newer than --resume {out / 'step_2'} (step_4), which this run "
               "would replace: pass --overwrite to set them aside (removed once this run's first checkpoint "
               "is written), or choose another --out")
    assert run_on_ranks(_train_or_refuse_body, 1, argv) == [message]
    with pytest.raises(rundir.RunDirError) as refused:
        rundir.check(out, resume=True, overwrite=False, resume_from=out / "step_2")
    assert str(refused.value) == message
    from tensorpar.cli.main import main

    assert main(["train", *TINY, "--steps", "3", "--nproc", "1", "--resume", str(out / "step_2")]) == 2  # out: RUN
    assert capsys.readouterr().err == f"tensorpar train: error: {message}\n"  # before any rank starts
    assert (out / "step_4" / "manifest.json").read_text() == newer and (out / "latest").read_text() == "step_4\n"
    # --overwrite: step_4 is set aside (latest names the resumed step meanwhile), gone after the first save.
    lock = rundir.claim(out, resume=True, overwrite=True, resume_from=out / "step_2")
    lock.release()
    assert (out / "latest").read_text() == "step_2\n"
    assert (lock.set_aside / "step_4" / "manifest.json").read_text() == newer
    os.rename(lock.set_aside / "step_4", out / "step_4")
    (out / "latest").write_text("step_4\n")
    lock.set_aside.rmdir()
    assert run_on_ranks(_train_or_refuse_body, 1, argv + ["--overwrite"]) == [[3]]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "latest", "loss.png", "metrics.jsonl", "step_2", "step_3"]


def test_resuming_a_run_into_another_runs_directory_is_refused_and_leaves_both_as_they_were(tmp_path, capsys):
    """`--resume A --out B`, B holding another run, wrote into B: its latest repointed, its
    config.toml replaced, its metrics appended to."""
    from tensorpar.cli.main import main

    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        run_on_ranks(_train_or_refuse_body, 1, TINY + ["--steps", "2", "--out", str(out)])
    before = {out: {name: (out / name).read_bytes() for name in ("latest", "metrics.jsonl")} for out in (a, b)}
    message = (f"--out {b} holds another run (latest, loss.png, metrics.jsonl, step_2) than --resume "
               f"{a / 'step_2'} continues: give --out {a} to continue there, or an --out that holds no run")
    assert main(["train", *TINY, "--steps", "3", "--nproc", "1", "--resume", str(a), "--out", str(b)]) == 2
    assert capsys.readouterr().err == f"tensorpar train: error: {message}\n"
    assert run_on_ranks(_train_or_refuse_body, 1, TINY + ["--steps", "3", "--resume", str(a), "--out", str(b)]) \
        == [message]
    assert {out: {name: (out / name).read_bytes() for name in before[out]} for out in (a, b)} == before
    # Into a directory that holds no run, it continues.
    assert run_on_ranks(_train_or_refuse_body, 1, TINY + ["--steps", "3", "--resume", str(a),
                                                          "--out", str(tmp_path / "c")]) == [[3]]


def test_a_run_stopped_before_its_first_checkpoint_is_started_over_in_one_step(tmp_path, capsys):
    """Ctrl-C before the first checkpoint was a dead end: running again said the directory holds a
    run (continue it with --resume), --resume then that it holds no checkpoint."""
    from tensorpar.cli.main import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')   # what a run leaves before its first save
    (out / "config.toml").write_text("steps = 100\n")
    assert main(["train", *TINY, "--steps", "2", "--nproc", "1", "--resume", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"tensorpar train: error: --resume: checkpoint {out}: the run there stopped before its first checkpoint, so "
        "there is nothing to resume: run the command again without --resume to start it over\n")
    assert main(["train", *TINY, "--steps", "2", "--nproc", "1", "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert f"--out {out} held a run stopped before its first checkpoint, started over: the previous run is kept in " \
        f"{out / '.previous-run-0'} until this run's first checkpoint is written" in said.out + said.err
    assert (out / "latest").read_text() == "step_2\n" and not (out / ".previous-run-0").exists()
    assert '"loss": 5.5' not in (out / "metrics.jsonl").read_text()
