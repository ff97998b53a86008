import os
import signal

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _interrupt_once(signum, frame):
    # Later Ctrl-Cs (an impatient user's) would break the clean-up that ends the ranks and, under
    # -n, xdist's workers: ignored from the first one on, before any Python code runs after it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def pytest_configure(config):
    signal.signal(signal.SIGINT, _interrupt_once)
