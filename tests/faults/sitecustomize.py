"""Fault injection for the CLI tests, active only in processes started with this directory on
PYTHONPATH (every rank of a launch imports it at start-up) and ``TENSORPAR_FAULT`` set:

- ``batch:R:S``: rank R's batch for step S raises ValueError (a bad batch);
- ``metrics-enospc:R:S``: rank R's metrics.jsonl row for step S fails with "No space left on device";
- ``mark:R:S``: nothing fails, the stamp is written when rank R takes its batch for step S;
- ``slow-save:R:S``: rank R's save of step S stops for a minute once its tensors are written.

When it fires, the time is written to the file ``TENSORPAR_FAULT_STAMP`` names (if set).
"""

import errno
import os
import time

_KIND, _RANK, _STEP = (os.environ.get("TENSORPAR_FAULT", "") + "::").split(":")[:3]


def _fire() -> None:
    stamp = os.environ.get("TENSORPAR_FAULT_STAMP")
    if stamp:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))


def _here() -> bool:
    # Read when the fault would fire: the launcher sets RANK after this module runs.
    return os.environ.get("RANK", "0") == _RANK


def _install() -> None:
    step = int(_STEP)
    if _KIND in ("batch", "mark"):
        from tensorpar.training.data import BatchSampler

        real = BatchSampler.micro_batches

        def micro_batches(self, index):
            if index == step - 1 and self.stream == 0 and _here():
                _fire()
                if _KIND == "batch":
                    raise ValueError(f"bad batch at step {step}")
            return real(self, index)
        BatchSampler.micro_batches = micro_batches
    elif _KIND == "slow-save":
        import torch.distributed.checkpoint as dcp

        real = dcp.save

        def save(state, *, storage_writer):
            real(state, storage_writer=storage_writer)
            if storage_writer.path.name == f"step_{step}.tmp" and _here():
                _fire()
                time.sleep(60)
        dcp.save = save
    elif _KIND == "metrics-enospc":
        import json

        from tensorpar.training import progress

        real = progress.append_line

        def append_line(path, line):
            if json.loads(line).get("step") == step and _here():
                _fire()
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(path, line)
        progress.append_line = append_line


if _KIND:
    _install()
