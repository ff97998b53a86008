import os
import signal

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_keyboard_interrupt(excinfo):
    """After the first Ctrl-C, later ones (an impatient user's) would break the clean-up that ends
    the ranks and, under ``-n``, the workers: ignored from here on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
