"""Even shapes against the tree before the uneven-layout work (issue 17): bit for bit and no slower.

A GPT training step (``gpt_step.py``'s: forward, loss, backward, DP grad reduction, SP grad sum,
clipping, AdamW) at even shapes, at one TP size with and without SP, run by the current tree
and by ``--baseline`` (``git archive`` of its ``src/`` into a temporary directory; the working
tree is not touched), each in its own spawned gloo world with one thread per rank; PYTHONPATH
decides which tree a world imports::

    python benchmarks/even_shapes_vs_before.py [--baseline REV] [--current REV] [--tp 2] [--rounds 7]

``--current REV`` times that revision's ``src/`` instead of the working tree's (e.g. the merge of
the uneven work against its first parent, to leave out everything else merged since ``BASELINE``).

Both worlds are started once and stay up; a round runs one world, then the other (the order
alternates from round to round), so both meet the same load on shared cores. Reported per
variant: each tree's median step time (the slowest rank's wall time) and CPU time (summed
over the ranks: what the step costs, less sensitive than wall time to other processes taking the
cores), the per-round ratios current/baseline of both (below 1: the current tree is faster) and
their medians. Checked: the losses of the first ``--warmup`` steps and every rank's final weights
(after all the steps both trees ran) are bit-identical between the trees; exit status 1 when they
are not.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gpt_step import add_arguments, build_step

# The parent of 6321b1d, the first commit of the uneven layouts ("issue 17 stage 1").
BASELINE = "89f13ed755615c73faca7fe2ee32c459902d00d7"
REPO = Path(__file__).resolve().parents[1]
TREES = ("current", "baseline")
VARIANTS = {"tp": False, "tp_sp": True}
_STORE_TIMEOUT = timedelta(hours=2)


def _rank(args) -> None:
    """One rank of one tree's world: build both variants, then time a round whenever told to."""
    import tensorpar as tp

    if not Path(tp.__file__).resolve().is_relative_to(Path(args.src).resolve()):
        raise RuntimeError(f"{args.worker} tree: tensorpar imported from {tp.__file__}, not {args.src}")
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=_STORE_TIMEOUT)
    tp.initialize_model_parallel(args.tp)
    rank, tree = dist.get_rank(), args.worker
    steps, models, losses = {}, {}, {}
    for name, sp in VARIANTS.items():
        steps[name], models[name] = build_step(argparse.Namespace(**vars(args), sp=sp))
        losses[name] = [float(steps[name]().detach()).hex() for _ in range(args.warmup)]
    store.set(f"{tree}/ready/{rank}", json.dumps({"losses": losses, "tensorpar": tp.__file__}))
    for r in range(args.rounds):
        store.wait([f"{tree}/go/{r}"])
        ms = {}
        for name in (VARIANTS if r % 2 == 0 else reversed(VARIANTS)):
            began, cpu_began = time.perf_counter(), time.process_time()
            for _ in range(args.iters):
                loss = steps[name]()
            float(loss.detach())  # every step's work is done
            wall = torch.tensor(time.perf_counter() - began, dtype=torch.float64)
            cpu = torch.tensor(time.process_time() - cpu_began, dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
            dist.all_reduce(cpu)
            ms[name] = 1e3 * wall.item() / args.iters
            ms[f"{name}_cpu"] = 1e3 * cpu.item() / args.iters
        if rank == 0:
            store.set(f"{tree}/done/{r}", json.dumps(ms))
    store.wait(["finish"])  # hashing and exiting here would take cores from the other world's last round
    weights = {name: {n: hashlib.sha256(p.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
                      for n, p in model.named_parameters()} for name, model in models.items()}
    store.set(f"{tree}/final/{rank}", json.dumps(weights))


def _worker(args) -> None:
    try:
        from tensorpar.cli.launch import launch_local
    except ImportError:  # trees before 0.4 keep the launcher at the package root
        from tensorpar.launch import launch_local

    launch_local(_rank, args, nproc=args.tp)


def _extract_src(rev: str, into: Path) -> str:
    """``rev``'s ``src/`` under ``into``; returns its full commit hash and subject."""
    commit = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%H %s", rev, "--"],
                            check=True, capture_output=True, text=True).stdout.strip()
    tar = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit.split()[0], "src"],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return commit


class _Worlds:
    """Both trees' worlds, driven through one TCPStore that this process serves."""

    def __init__(self, args, sources: dict[str, Path]) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=_STORE_TIMEOUT)
        self.procs = {}
        for tree, src in sources.items():
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
            command = [sys.executable, __file__, *sys.argv[1:], "--worker", tree, "--src", str(src),
                       "--store-port", str(self.store.port)]
            self.procs[tree] = subprocess.Popen(command, env=env, cwd=REPO)

    def wait(self, tree: str, key: str) -> bytes:
        """The value of ``tree``'s ``key`` once set; raises as soon as that world has ended without it."""
        key, proc = f"{tree}/{key}", self.procs[tree]
        while not self.store.check([key]):
            if proc.poll() is not None and not self.store.check([key]):
                raise RuntimeError(f"the {tree} tree's world ended (exit {proc.returncode}) before setting {key}")
            time.sleep(0.05)
        return self.store.get(key)

    def close(self, *, stop: bool) -> None:
        """Stop the worlds now, or let them end (they do after their last key) and stop any that hang."""
        for proc in self.procs.values():
            try:
                proc.wait(timeout=0 if stop else 60)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait()


def _compare(args, worlds: _Worlds) -> dict:
    """Per variant: whether the first losses and every rank's final weights are bit-identical."""
    result = {}
    ready = {t: [json.loads(worlds.wait(t, f"ready/{r}")) for r in range(args.tp)] for t in TREES}
    final = {t: [json.loads(worlds.wait(t, f"final/{r}")) for r in range(args.tp)] for t in TREES}
    for name in VARIANTS:
        losses = [ready[t][0]["losses"][name] for t in TREES]
        differ = sorted({n for r in range(args.tp) for n in final["current"][r][name] | final["baseline"][r][name]
                         if final["current"][r][name].get(n) != final["baseline"][r][name].get(n)})
        result[name] = {"losses_identical": losses[0] == losses[1],
                        "first_losses": [float.fromhex(x) for x in losses[0]],
                        "weights_identical": not differ, "weights_differing": differ}
    return result


def _drive(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="tensorpar-trees-") as tmp:
        revisions = {"baseline": _extract_src(args.baseline, Path(tmp, "baseline"))}
        sources = {"current": REPO / "src", "baseline": Path(tmp, "baseline", "src")}
        if args.current:
            revisions["current"] = _extract_src(args.current, Path(tmp, "current"))
            sources["current"] = Path(tmp, "current", "src")
        else:
            revisions["current"] = f"the working tree {REPO}"
        uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
        worlds = _Worlds(args, sources)
        try:
            for tree in TREES:
                for r in range(args.tp):
                    worlds.wait(tree, f"ready/{r}")
            ms = {t: [] for t in TREES}
            for r in range(args.rounds):
                for tree in (TREES if r % 2 == 0 else reversed(TREES)):
                    worlds.store.set(f"{tree}/go/{r}", "1")
                    ms[tree].append(json.loads(worlds.wait(tree, f"done/{r}")))
            worlds.store.set("finish", "1")
            identical = _compare(args, worlds)
        except BaseException:
            worlds.close(stop=True)
            raise
        worlds.close(stop=False)
        uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "src", "store_port")},
              "trees": revisions, "uptime_before_after": uptime}
    for name in VARIANTS:
        report[name] = {}
        for measure, key in (("", name), ("cpu_", f"{name}_cpu")):
            ratios = [c[key] / b[key] for c, b in zip(ms["current"], ms["baseline"])]
            report[name].update({
                f"current_{measure}ms": statistics.median(c[key] for c in ms["current"]),
                f"baseline_{measure}ms": statistics.median(b[key] for b in ms["baseline"]),
                f"current_over_baseline_{measure}per_round": [round(x, 3) for x in ratios],
                f"current_over_baseline_{measure}median": statistics.median(ratios)})
        report[name].update(identical[name])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, dtype="fp32", sp=False)
    parser.set_defaults(dtype="fp32", layers=2, seq=128, vocab=4096)
    parser.add_argument("--baseline", default=BASELINE, help="the revision to compare with (default: %(default)s)")
    parser.add_argument("--current", help="a revision to time instead of the working tree")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps, whose losses are compared")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--worker", choices=TREES, help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    report = _drive(args)
    print(json.dumps(report, indent=1))
    if not all(report[name]["losses_identical"] and report[name]["weights_identical"] for name in VARIANTS):
        sys.exit(1)


if __name__ == "__main__":
    main()
