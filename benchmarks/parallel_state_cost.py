"""What repeated ``initialize_model_parallel``/``destroy_model_parallel`` costs on gloo ranks.

Megatron's unit tests initialise and destroy the groups once per test. This repeats that
``--cycles`` times on ``--nproc`` gloo ranks, with tensorpar's parallel_state or megatron-core's
(``--impl megatron``, needs megatron-core importable), and prints per cycle: seconds, process
groups alive, OS threads and open file descriptors of rank 0. Run it under the CPU lock::

    flock /tmp/tensorpar-cpu.lock python benchmarks/parallel_state_cost.py --impl tensorpar
    PYTHONPATH=/path/to/megatron-core flock /tmp/tensorpar-cpu.lock python benchmarks/parallel_state_cost.py --impl megatron
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _process_counts() -> tuple[int, int]:
    status = Path("/proc/self/status").read_text()
    threads = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
    return threads, len(os.listdir("/proc/self/fd"))


def worker(args) -> None:
    import torch.distributed as dist

    if args.impl == "megatron":
        import megatron.core.parallel_state as ps
    else:
        import tensorpar.parallel_state as ps
    dist.init_process_group("gloo")
    rows = []
    for _ in range(args.cycles):
        start = time.perf_counter()
        ps.initialize_model_parallel(args.tp, args.pp)
        dist.barrier()
        ps.destroy_model_parallel()
        seconds = time.perf_counter() - start
        threads, fds = _process_counts()
        rows.append({"seconds": round(seconds, 3), "groups_alive": len(dist.distributed_c10d._world.pg_map),
                     "threads": threads, "fds": fds})
    if dist.get_rank() == 0:
        print(json.dumps({"impl": args.impl, "tp": args.tp, "pp": args.pp, "cycles": rows}))
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("tensorpar", "megatron"), default="tensorpar")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               str(Path(__file__).resolve()), "--worker", f"--impl={args.impl}", f"--tp={args.tp}", f"--pp={args.pp}",
               f"--cycles={args.cycles}"]
    subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    main()
