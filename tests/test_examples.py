"""The README's example is examples/gpt_step.py, and it runs under torchrun as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tensorpar.cli.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt_step.py"


def test_the_readme_shows_the_example_file_as_it_is():
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.M | re.S)
    assert EXAMPLE.read_text() in blocks


@pytest.mark.slow
def test_readme_gpt_example_trains_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE)],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", result.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0], result.stdout
