"""The local launcher: a rank's exception reaches the caller as one line naming the rank, fast."""

import contextlib
import datetime
import ipaddress
import json
import os
import signal
import tempfile
import time

import pytest

from tensorpar.errors import UsageError
from tensorpar.cli.errors import one_line
from tensorpar.cli.launch import LaunchError, launch_local

PG_TIMEOUT_S = 300


def _fail_on_rank1_while_rank0_waits(kind: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    if dist.get_rank() == 1:
        if kind == "usage":
            raise UsageError("--widgets 3 is not a multiple of 2")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits for a peer that is gone: the launcher must end it


def test_a_rank_exception_is_reported_once_with_its_rank_and_ends_the_others():
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch_local(_fail_on_rank1_while_rank0_waits, "usage", nproc=2)
    # Rank 0 was stuck in a collective with a PG_TIMEOUT_S timeout; the launcher ended it.
    assert time.monotonic() - started < PG_TIMEOUT_S / 5
    assert str(info.value) == "--widgets 3 is not a multiple of 2 (rank 1)"
    assert info.value.rank == 1 and info.value.exit_code == 2
    assert "raise UsageError" in info.value.traceback


def _temporary_directory():
    return tempfile.gettempdir()


def test_a_launch_leaves_no_files_in_the_temporary_directory(monkeypatch, tmp_path):
    """torch elastic's per-rank folders and the error file of the rank it ended go with the launch;
    the ranks' own temporary directory (inductor's cache, say) is the user's, not that folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert launch_local(_temporary_directory, nproc=2) == {0: str(tmp_path), 1: str(tmp_path)}
    with pytest.raises(LaunchError):
        launch_local(_fail_on_rank1_while_rank0_waits, "usage", nproc=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    assert tempfile.gettempdir() == str(tmp_path)


def test_a_rank_killed_by_a_signal_is_named():
    with pytest.raises(LaunchError, match=r"^killed by signal SIGKILL \(rank 1\)$"):
        launch_local(_fail_on_rank1_while_rank0_waits, "signal", nproc=2)


def _stop_rank1_while_rank0_waits():
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process states are read from Linux's /proc")
def test_a_stopped_rank_is_named_not_the_timeout_of_the_rank_waiting_for_it():
    with pytest.raises(LaunchError, match=r"^rank 1 \(pid \d+\) stopped responding: its process was stopped "
                                          r"\(SIGSTOP\); a collective timed out waiting for it \(rank 0\)$"):
        launch_local(_stop_rank1_while_rank0_waits, nproc=2)


def test_a_stopped_peer_is_dated_before_it_is_continued(monkeypatch, tmp_path):
    # Continued, the peer fails at once and may write its error first: the launcher must still
    # report this rank's, so its time is taken before the peer runs again.
    from tensorpar.cli import launch

    continued_at = []
    monkeypatch.setattr(launch, "_stopped_peers", lambda: {1: 12345})
    monkeypatch.setattr(launch.os, "kill", lambda pid, sig: continued_at.append(time.time()))

    def waits_for_the_stopped_peer():
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    with pytest.raises(launch.PeerStopped) as info:
        launch._run_rank(waits_for_the_stopped_peer)
    assert continued_at and info.value.failed_at <= continued_at[0]
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    time.sleep(0.01)
    launch.OneLineErrorHandler().record_exception(info.value)
    assert json.loads((tmp_path / "error.json").read_text())["tensorpar"]["time"] == info.value.failed_at


def test_one_line_keeps_our_messages_and_names_other_types():
    assert one_line(UsageError("--lr nan is not a finite number")) == "--lr nan is not a finite number"
    assert one_line(ValueError("bad\n  value\n")) == "ValueError: bad value"
    assert one_line(KeyError("step")) == "KeyError: 'step'"
    assert one_line(RuntimeError()) == "RuntimeError"


def _max_connections():
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")


@pytest.mark.parametrize("cuda, preset, expected", [(True, None, "1"), (True, "8", "8"), (False, None, None)])
def test_cuda_runs_get_one_device_connection_before_any_rank_starts(monkeypatch, cuda, preset, expected):
    """Item 6: set for CUDA children by the launcher (a user's own value wins); not on CPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if preset is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", preset)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)   # launch_local(nproc=1) sets them here
    assert launch_local(_max_connections, nproc=1) == {0: expected}


def _world_env():
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def test_one_process_runs_here_and_leaves_no_world_behind(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    inside = launch_local(_world_env, nproc=1)[0]
    assert inside["RANK"] == "0" and inside["WORLD_SIZE"] == "1"
    # A later command in this process must not think it runs under torchrun.
    assert set(_world_env().values()) == {None}


_SET_BEFORE_THE_LAUNCH = {"marker": None}


def _inherited_marker():
    import gc

    return _SET_BEFORE_THE_LAUNCH["marker"], gc.get_freeze_count() > 0


@pytest.mark.parametrize("chosen, inherited", [(None, None), ("fork", "set here"),
                                               pytest.param("spawn", None, marks=pytest.mark.slow)])
def test_ranks_start_from_a_fresh_server_unless_fork_is_asked_for(monkeypatch, chosen, inherited):
    """By default a rank forks from a fresh single-threaded server (forkserver), so it does not
    inherit this process's state (this marker); ``fork`` is an explicit opt-in, its inherited heap frozen
    out of the rank's garbage collector's reach. This process's heap is not left frozen."""
    import gc

    if chosen is None:
        monkeypatch.delenv("TENSORPAR_START_METHOD", raising=False)
    else:
        monkeypatch.setenv("TENSORPAR_START_METHOD", chosen)
    monkeypatch.setitem(_SET_BEFORE_THE_LAUNCH, "marker", "set here")
    got = launch_local(_inherited_marker, nproc=2)
    assert [marker for marker, _ in got.values()] == [inherited, inherited]
    if chosen == "fork":
        assert all(frozen for _, frozen in got.values())
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("available, chosen, expected", [
    (["fork", "spawn", "forkserver"], None, "forkserver"), (["spawn"], None, "spawn"),
    (["fork", "spawn", "forkserver"], "fork", "fork")])
def test_the_start_method_is_forkserver_where_there_is_one_and_fork_only_when_asked(monkeypatch, available,
                                                                                      chosen, expected):
    import multiprocessing

    from tensorpar.cli.launch import start_method

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: available)
    if chosen is None:
        monkeypatch.delenv("TENSORPAR_START_METHOD", raising=False)
    else:
        monkeypatch.setenv("TENSORPAR_START_METHOD", chosen)
    assert start_method() == expected


def test_an_unknown_start_method_is_one_line(monkeypatch):
    monkeypatch.setenv("TENSORPAR_START_METHOD", "vfork")
    with pytest.raises(UsageError, match=r"^TENSORPAR_START_METHOD must be one of fork, forkserver, spawn, "
                                         r"got 'vfork'$"):
        launch_local(_inherited_marker, nproc=2)


def _affinity_of_its_threads():
    """This rank's intra-op thread count, and the CPUs of each of its threads (one started here included)."""
    import threading

    import torch

    started = []  # pid 0: the calling thread
    thread = threading.Thread(target=lambda: started.append(tuple(sorted(os.sched_getaffinity(0)))))
    thread.start()
    thread.join()
    masks = {tuple(sorted(os.sched_getaffinity(0))), *started}
    for task in os.listdir("/proc/self/task"):
        try:
            masks.add(tuple(sorted(os.sched_getaffinity(int(task)))))
        except OSError:
            pass  # a thread that has just ended
    return torch.get_num_threads(), sorted(masks)


def test_each_cpu_rank_gets_its_share_of_the_threads_and_no_binding(monkeypatch):
    """Two ranks on this node: half the CPUs' threads each, every thread free to run on any CPU
    the launcher may use (the scheduler places them)."""
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("CPU affinity is Linux's")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the tests' own; the launcher shares the cores
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    expected = (max(1, len(allowed) // 2), [allowed])
    assert launch_local(_affinity_of_its_threads, nproc=2) == {0: expected, 1: expected}


def _threads_on_one_cpu():
    import torch

    from tensorpar.cli.launch import set_threads

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # alone on the node: its share is every CPU it may use
    set_threads()
    return torch.get_num_threads()


def test_threads_follow_the_cpus_a_process_may_use_not_the_machines_count(monkeypatch):
    """Under ``taskset -c 0`` on a many-core machine one process got a thread per core of the
    machine, all on the one CPU."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("CPU affinity is Linux's")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch_local(_threads_on_one_cpu, nproc=2) == {0: 1, 1: 1}


def _shared_memory_after_collectives():
    import torch
    import torch.distributed as dist

    from tensorpar.distributed import comm

    dist.init_process_group("gloo")
    try:
        for numel in (8, 1 << 20):  # small and large, each of the collectives
            x = torch.ones(numel * dist.get_world_size())
            comm.all_reduce(x, dist.group.WORLD)
            comm.all_gather(x, dist.group.WORLD)
            comm.reduce_scatter(x, dist.group.WORLD)
        dist.barrier()
        return sorted(os.listdir("/dev/shm"))
    finally:
        dist.destroy_process_group()


def test_a_two_rank_cpu_run_creates_no_file_in_dev_shm():
    """The collectives travel through torch's gloo: nothing in shared memory but the semaphores
    of Python's multiprocessing (``sem.mp-*``), which the launcher's queues hold."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    before = set(os.listdir("/dev/shm"))
    during = launch_local(_shared_memory_after_collectives, nproc=2)
    made = [{name for name in set(files) - before if not name.startswith("sem.mp-")} for files in during.values()]
    assert made == [set(), set()]


def _environment_variable(name):
    return os.environ.get(name)


def test_a_rank_sees_the_launchers_environment_at_the_launch(monkeypatch):
    """A variable set, or removed, after the server the ranks fork from started still reaches them
    as the launcher has it."""
    launch_local(_environment_variable, "PATH", nproc=2)  # the server runs from here on
    monkeypatch.setenv("TENSORPAR_TEST_SET_LATE", "yes")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch_local(_environment_variable, "TENSORPAR_TEST_SET_LATE", nproc=2) == {0: "yes", 1: "yes"}
    assert launch_local(_environment_variable, "OMP_NUM_THREADS", nproc=2) == {0: None, 1: None}


def _listening(pid: int) -> list[str]:
    """The addresses process ``pid``'s TCP sockets listen on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    raw = bytes.fromhex(fields[1].split(":")[0])
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    addresses.append(str(ipaddress.ip_address(raw)))
    return addresses


def _listening_body(launcher: int) -> tuple[list[str], list[str]]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    dist.barrier()
    found = _listening(launcher), _listening(os.getpid())
    dist.barrier()
    dist.destroy_process_group()
    return found


def _loopback(address: str) -> bool:
    parsed = ipaddress.ip_address(address)
    return parsed.is_loopback or (parsed.version == 6 and parsed.ipv4_mapped is not None
                                  and parsed.ipv4_mapped.is_loopback)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the sockets from /proc")
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_local_launch_listens_on_the_loopback_address_only(nproc):
    """The launcher's rendezvous store (which the ranks use; with one process, the one it runs
    in) and the ranks' own sockets: torch's TCPStore binds every interface unless handed a
    bound socket. What this process listened on before the launch is not the launch's."""
    before = _listening(os.getpid())
    results = launch_local(_listening_body, os.getpid(), nproc=nproc)
    launcher = list(results[0][0])
    for address in before:
        launcher.remove(address)
    assert launcher, "the launcher's store was not found listening"
    for rank, (_, of_rank) in results.items():
        assert all(_loopback(a) for a in launcher + of_rank), (rank, launcher, of_rank)
