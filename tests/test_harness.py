"""The test harness itself: timeouts that scale with the machine's load, worlds replaced once they hold
leaked transport threads, and Ctrl-C that stops pytest."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import harness

ROOT = Path(__file__).resolve().parents[1]


def sleeping_body(marker: str) -> None:
    Path(f"{marker}.{os.environ['RANK']}").touch()
    time.sleep(120)


def test_the_load_factor_is_one_when_idle_and_grows_with_the_load_per_core(monkeypatch):
    monkeypatch.delenv("TENSORPAR_TEST_LOAD_FACTOR", raising=False)
    assert harness._measured_load_factor(1.5, 2) == 1.0
    assert harness._measured_load_factor(6.0, 2) == 3.0
    assert harness._measured_load_factor(6.0, 4) == 1.5
    assert harness._measured_load_factor(1000.0, 2) == harness.MAX_LOAD_FACTOR
    monkeypatch.setenv("TENSORPAR_TEST_LOAD_FACTOR", "4")
    assert harness._measured_load_factor(0.0, 2) == 4.0


_KEPT = []


def _leaking_body() -> int:
    import torch
    import torch.distributed as dist

    for _ in range(harness.MAX_TRANSPORT_THREADS + 1):
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1), group=group)
        _KEPT.append(group)   # never destroyed, as torch keeps some of a body's groups
    return os.getpid()


def _pid_and_threads_body() -> tuple[int, int]:
    return os.getpid(), harness._transport_threads()


def test_a_world_left_holding_transport_threads_is_replaced():
    first = harness.run_on_ranks(_pid_and_threads_body, 2)
    assert all(threads <= harness.MAX_TRANSPORT_THREADS for _, threads in first)
    leaked = harness.run_on_ranks(_leaking_body, 2)
    after = harness.run_on_ranks(_pid_and_threads_body, 2)
    assert not {pid for pid, _ in after} & set(leaked)
    assert all(threads <= harness.MAX_TRANSPORT_THREADS for _, threads in after), after
    assert harness.run_on_ranks(_pid_and_threads_body, 2) == after   # a clean world is kept


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist-2-workers"])
def test_ctrl_c_stops_the_suite_and_its_ranks(tmp_path, workers):
    marker = tmp_path / "started"
    (tmp_path / "test_sleeps.py").write_text(textwrap.dedent(f"""
        from tests import harness
        from tests.harness import run_on_ranks
        from tests.test_harness import sleeping_body

        harness.PRELOAD[:] = ["tests.harness", "torch.distributed"]  # the ranks run no command

        def test_one():
            run_on_ranks(sleeping_body, 2, {str(marker)!r})

        def test_two():
            run_on_ranks(sleeping_body, 2, {str(marker)!r})
        """))
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure  # noqa: F401\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "OMP_NUM_THREADS": "1"}
    # A terminal's Ctrl-C signals the whole foreground process group: pytest and every rank.
    suite = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers,
                              str(tmp_path)],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not all(Path(f"{marker}.{rank}").exists() for rank in range(2)):
            assert suite.poll() is None and time.monotonic() < deadline, suite.communicate()[0]
            time.sleep(0.2)
        for _ in range(2):  # an impatient user presses it twice
            os.killpg(suite.pid, signal.SIGINT)
            time.sleep(0.5)
        output, _ = suite.communicate(timeout=60)
    finally:
        if suite.poll() is None:
            os.killpg(suite.pid, signal.SIGKILL)
    assert suite.returncode == 2, output                  # pytest's "interrupted"
    assert "KeyboardInterrupt" in output and "test_two" not in output and "passed" not in output, output
    deadline = time.monotonic() + 15  # multiprocessing's resource tracker exits once it sees pytest gone
    while (survivors := _session_processes(suite.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not survivors, survivors


@pytest.mark.slow
def test_ranks_end_within_seconds_of_a_pytest_process_killed_mid_body(tmp_path):
    marker = tmp_path / "started"
    script = textwrap.dedent(f"""
        from tests import harness
        from tests.test_harness import sleeping_body

        harness.PRELOAD[:] = ["tests.harness", "torch.distributed"]
        harness.run_on_ranks(sleeping_body, 2, {str(marker)!r})
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "OMP_NUM_THREADS": "1"}
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not all(Path(f"{marker}.{rank}").exists() for rank in range(2)):
            assert owner.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        owner.kill()   # no atexit, no KeyboardInterrupt: nothing of the owner's closes its world
        owner.wait()
        deadline = time.monotonic() + 15
        while (survivors := _session_processes(owner.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not survivors, survivors
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)


def _session_processes(session: int) -> list[str]:
    listed = subprocess.run(["ps", "-eo", "sid=,args="], capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if line.split(maxsplit=1)[0] == str(session)]


def _leave_state_behind_body() -> int:
    import torch

    import tensorpar as tp

    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(3)
    tp.CommLedger().__enter__()  # never left
    tp.get_global_memory_buffer().get_tensor([4], torch.float32, "left")
    tp.get_rng_tracker().add("left-behind", 1)
    return os.getpid()


def _state_body() -> tuple:
    import torch

    import tensorpar as tp
    from tensorpar.distributed import comm_ledger

    return (os.getpid(), str(torch.get_default_dtype()), torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(), len(comm_ledger._ACTIVE_LEDGERS),
            len(tp.get_global_memory_buffer()._buffers), "left-behind" in tp.get_rng_tracker().get_states())


def test_a_body_meets_none_of_the_state_the_last_body_left_in_its_rank():
    pids = harness.run_on_ranks(_leave_state_behind_body, 2)
    after = harness.run_on_ranks(_state_body, 2)
    assert [pid for pid, *_ in after] == pids  # the same world, its ranks reused
    assert [state for _, *state in after] == [["torch.float32", True, False, 1, 0, 0, False]] * 2
