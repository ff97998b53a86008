"""The package itself: ``import tensorpar`` loads the library and nothing of the launcher or the CLI."""

import subprocess
import sys

LAUNCHER_SIDE = ("torch.distributed.elastic", "tensorpar.tools", "tensorpar.cli", "tensorpar.training")


def test_import_tensorpar_loads_no_launcher_elastic_or_cli_module():
    code = ("import sys, tensorpar, tensorpar.errors, tensorpar.models; "
            f"print(sorted(m for m in sys.modules if m.startswith({LAUNCHER_SIDE!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_errors_keeps_the_names_the_library_and_commands_use():
    from tensorpar.errors import UsageError, check_index_range, exit_code, one_line, report  # noqa: F401
    from tensorpar.tools.launch import OneLineErrorHandler  # noqa: F401

    assert exit_code(UsageError("--tp 3")) == 2 and one_line(UsageError("a\nb")) == "a b"


def test_the_moved_entry_points_still_work_and_say_they_moved():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import tensorpar.cli\nexcept DeprecationWarning as w:\n    print(w)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "tensorpar.tools.cli" in done.stdout, done.stdout + done.stderr
    for old in ("tensorpar.cli", "tensorpar.gpu_check"):
        done = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "usage:" in done.stdout, (old, done.stderr)
        assert "deprecated" in done.stderr, (old, done.stderr)
