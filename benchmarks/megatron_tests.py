"""megatron-core's own parallel_state and tensor_parallel unit tests, run against tensorpar.

A one-off measurement, never part of the suite (it needs a megatron checkout and 8 ranks).
It fetches nothing: give it a megatron-core checkout (or an unpacked archive) holding
``tests/unit_tests``. The test files are copied into a temporary directory with only their
imports changed (``megatron.core.parallel_state`` -> ``tensorpar.parallel_state``,
``megatron.core.tensor_parallel[.x]`` -> ``tensorpar.tensor_parallel[.x]``) and CUDA mapped to the CPU (``.cuda()``
dropped, ``device="cuda"`` -> CPU, ``torch.cuda.manual_seed``/``get_rng_state`` -> the CPU
generator's, NCCL -> gloo, ``torch.cuda.device_count()`` -> the world size). Transformer
Engine classes become ``None``; ``TransformerConfig`` becomes a stand-in carrying the fields the
layers read. pytest then runs on ``--nproc`` gloo ranks under torchrun; a test passes when it
passes on every rank. Run it under the CPU lock::

    git --git-dir=/work/.mirror/NVIDIA+Megatron-LM/repo archive core_v0.16.1 tests | tar -x -C /tmp/meg
    flock /tmp/tensorpar-cpu.lock python benchmarks/megatron_tests.py /tmp/meg --tensorpar-src src
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

TEST_FILES = ["tests/unit_tests/test_parallel_state.py", "tests/unit_tests/tensor_parallel"]
# Tests not run, and why (counted as not passed): gloo cannot do what they ask, and a rank left
# waiting would hang every test after them.
DESELECTED = {
    "tests/unit_tests/test_parallel_state.py::test_expert_all_gather_group":
        "each rank calls new_group with its own ranks: gloo's new_group needs every rank to name the same ones",
}
# (pattern, replacement), applied in order to every copied test file and to test_utilities.py.
REWRITES = [
    (r"^import megatron\.core\.parallel_state as (\w+)", r"import tensorpar.parallel_state as \1"),
    (r"^from megatron\.core import parallel_state\b", "from tensorpar import parallel_state"),
    (r"\bmegatron\.core\.tensor_parallel\b", "tensorpar.tensor_parallel"),  # its modules, the same names
    (r"^from megatron\.core import tensor_parallel\b", "from tensorpar import tensor_parallel"),
    (r"^from megatron\.core\.utils import", "from tensorpar.parallel_state import"),
    (r"^from megatron\.core\.process_groups_config import", "from tensorpar.process_groups_config import"),
    (r"^from megatron\.core\.models\.\S+ import (\w+) as (\w+)$", r"\2 = None  # megatron.core.models: not ported"),
    (r"^from megatron\.core\.transformer\.transformer_config import", "from tests.unit_tests.stand_ins import"),
    (r"^from megatron\.core\.extensions\.transformer_engine import (.+)$",
     lambda m: " = ".join(n.strip() for n in m.group(1).split(",")) + " = None  # Transformer Engine"),
    # (0.19's test_utilities: helpers of megatron's training scripts, which these tests do not call)
    (r"^from megatron\.training\.argument_utils import \(([^)]*)\)",
     lambda m: " = ".join(n.strip() for n in m.group(1).split(",") if n.strip()) + " = None  # megatron.training"),
    (r"\.cuda\(\)", ""),
    (r"device=\"cuda\"", "device=\"cpu\""),
    (r"torch\.cuda\.manual_seed\(", "torch.manual_seed("),
    (r"torch\.cuda\.get_rng_state\(\)", "torch.get_rng_state()"),
    (r"torch\.cuda\.is_available\(\)", "True"),
    (r"torch\.cuda\.set_device\([^\n]*\)", "None"),
    (r"torch\.cuda\.synchronize\(\)", "None"),
    (r"torch\.cuda\.memory\.empty_cache\(\)", "None"),
    (r"torch\.cuda\.device_count\(\)", "int(os.environ['WORLD_SIZE'])"),
    (r"backend='nccl'", "backend='gloo'"),
]
CONFTEST = '''import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    # The default group exists before the first test: tensorpar's initialize_model_parallel
    # would otherwise start (and later tear down) one from torchrun's environment, and
    # Utils' second rendezvous on the same store hangs.
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_distributed()
    yield
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def reset_env_vars():
    original = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(original)
'''
STAND_INS = '''import torch

import tensorpar


class TransformerConfig:
    """The fields of megatron's TransformerConfig that the tensor-parallel layers read."""

    def __init__(self, num_layers, hidden_size, num_attention_heads, use_cpu_initialization=False,
                 init_method_std=0.02, params_dtype=torch.float32, sequence_parallel=False,
                 perform_initialization=True, **others):
        self.num_layers, self.hidden_size, self.num_attention_heads = num_layers, hidden_size, num_attention_heads
        self.use_cpu_initialization, self.params_dtype = use_cpu_initialization, params_dtype
        self.sequence_parallel, self.perform_initialization = sequence_parallel, perform_initialization
        self.init_method = tensorpar.init_method_normal(init_method_std)
        vars(self).update(others)  # the other fields a test sets, held as given
'''


def rewrite(text: str) -> str:
    for pattern, replacement in REWRITES:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    if "os.environ" in text and not re.search(r"^import os$", text, flags=re.MULTILINE):
        text = "import os\n" + text
    return text


def prepare(checkout: Path, into: Path) -> list[str]:
    """The rewritten tests under ``into``; returns the paths pytest runs."""
    for package in ("tests", "tests/unit_tests"):
        (into / package).mkdir(parents=True, exist_ok=True)
        (into / package / "__init__.py").write_text("")
    (into / "tests/unit_tests/conftest.py").write_text(CONFTEST)
    (into / "tests/unit_tests/stand_ins.py").write_text(STAND_INS)
    utilities = checkout / "tests/unit_tests/test_utilities.py"
    (into / "tests/unit_tests/test_utilities.py").write_text(rewrite(utilities.read_text()))
    for entry in TEST_FILES:
        source = checkout / entry
        files = sorted(source.glob("*.py")) if source.is_dir() else [source]
        for path in files:
            target = into / path.relative_to(checkout)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(rewrite(path.read_text()))
    return TEST_FILES


def outcomes(report_dir: Path, nproc: int) -> dict[str, tuple[str, str]]:
    """``test id -> (outcome, reason)`` over every rank: passed only if passed everywhere."""
    merged: dict[str, tuple[str, str]] = {}
    for rank in range(nproc):
        path = report_dir / f"rank{rank}.xml"
        if not path.exists():
            raise SystemExit(f"rank {rank} wrote no report ({path}): it crashed or hung; see the output above")
        for case in ET.parse(path).iter("testcase"):
            test = f"{case.get('classname')}::{case.get('name')}"
            outcome, reason = "passed", ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    outcome = "skipped" if kind == "skipped" else "failed"
                    reason = (found.get("message") or "").strip().splitlines()[0][:200] if found.get("message") else kind
                    break
            if merged.get(test, ("passed", ""))[0] == "passed":
                merged[test] = (outcome, reason)
    return merged


def worker(args) -> None:
    import pytest

    rank = os.environ["RANK"]
    sys.exit(pytest.main(["-q", "-x" if args.first_failure else "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "-o", "faulthandler_timeout=120", "--rootdir", str(args.workdir),
                          f"--junitxml={args.workdir}/reports/rank{rank}.xml",
                          *(f"--deselect={test}" for test in DESELECTED), *args.paths]))


def _defines(checkout: Path, test: str) -> bool:
    """Whether ``checkout`` holds the test ``path::name`` (a release may not have it yet)."""
    path, name = test.split("::")
    return (checkout / path).exists() and bool(re.search(rf"^def {name}\(", (checkout / path).read_text(), re.MULTILINE))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, help="megatron-core checkout holding tests/unit_tests")
    parser.add_argument("--tensorpar-src", type=Path, default=Path(__file__).resolve().parents[1] / "src",
                        help="the tensorpar source directory to test (default: this checkout's src)")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=900, help="seconds for the whole run")
    parser.add_argument("--json", type=Path, help="also write the outcomes here")
    parser.add_argument("--first-failure", action="store_true", help="stop at the first failing test")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.checkout is None or not (args.checkout / "tests/unit_tests/test_utilities.py").exists():
        parser.error(f"{args.checkout} is not a megatron-core checkout (no tests/unit_tests/test_utilities.py)")
    workdir = Path(tempfile.mkdtemp(prefix="megatron-tests-"))
    try:
        paths = prepare(args.checkout, workdir)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(args.tensorpar_src.resolve()), str(workdir)]),
                   OMP_NUM_THREADS="1")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   str(Path(__file__).resolve()), "--worker", "--workdir", str(workdir),
                   *(["--first-failure"] if args.first_failure else []), "--paths", *paths]
        launcher = subprocess.Popen(command, cwd=workdir, env=env)
        try:
            launcher.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            launcher.terminate()  # the launcher ends its ranks on SIGTERM; a kill would orphan them
            launcher.wait()
            raise SystemExit(f"the tests did not finish within {args.timeout}s")
        results = outcomes(workdir / "reports", args.nproc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results.update({test.replace("/", ".").replace(".py::", "::"): ("not run", why) for test, why in DESELECTED.items()
                    if _defines(args.checkout, test)})
    passed = sorted(t for t, (o, _) in results.items() if o == "passed")
    print(f"\n{len(passed)} of {len(results)} passed on all {args.nproc} ranks")
    for test, (outcome, reason) in sorted(results.items()):
        if outcome != "passed":
            print(f"{outcome:8} {test}: {reason}")
    if args.json:
        args.json.write_text(json.dumps({t: list(v) for t, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
