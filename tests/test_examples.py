"""The README's example runs under torchrun as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.harness import free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt_step.py"


def test_readme_gpt_example_trains_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE)],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", result.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0], result.stdout
