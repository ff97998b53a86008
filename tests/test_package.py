"""The package itself: ``import tensorpar`` loads the library and nothing of the launcher or the CLI."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER_SIDE = ("torch.distributed.elastic", "tensorpar.tools", "tensorpar.cli", "tensorpar.training")


@pytest.mark.slow
def test_import_tensorpar_loads_no_launcher_elastic_or_cli_module():
    code = ("import sys, tensorpar, tensorpar.errors, tensorpar.models; "
            f"print(sorted(m for m in sys.modules if m.startswith({LAUNCHER_SIDE!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_errors_keeps_the_names_the_library_and_commands_use():
    from tensorpar.errors import UsageError, check_index_range  # noqa: F401
    from tensorpar.tools.errors import exit_code, one_line, report  # noqa: F401
    from tensorpar.tools.launch import OneLineErrorHandler  # noqa: F401

    assert exit_code(UsageError("--tp 3")) == 2 and one_line(UsageError("a\nb")) == "a b"


@pytest.mark.slow
def test_the_moved_entry_points_still_work_and_say_they_moved():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import tensorpar.cli\nexcept DeprecationWarning as w:\n    print(w)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "tensorpar.tools.cli" in done.stdout, done.stdout + done.stderr
    for old in ("tensorpar.cli", "tensorpar.gpu_check"):
        done = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "usage:" in done.stdout, (old, done.stderr)
        assert "deprecated" in done.stderr, (old, done.stderr)


# The layers of DESIGN.md (and of docs/architecture.md's table), lowest first: a module imports
# only from its own layer or the ones before it. `tensorpar.pipeline` cuts the GPT into stages:
# above the models. `tensorpar` itself (the public names, GPT included) sits above them.
LAYERS = (
    ("tensorpar.errors", "tensorpar.porting", "tensorpar.rank_generator", "tensorpar.process_groups",
     "tensorpar.parallel_registry", "tensorpar.parallel_init", "tensorpar.parallel_state"),
    ("tensorpar.comm_ledger",),
    ("tensorpar.comm",),
    ("tensorpar.buffers",),
    ("tensorpar.overlap",),
    ("tensorpar.mappings", "tensorpar.tree_reduce", "tensorpar.lanewise", "tensorpar.utils"),
    ("tensorpar.initialization",),
    ("tensorpar.linear_function", "tensorpar.linear"),
    ("tensorpar.embedding", "tensorpar.cross_entropy", "tensorpar.keep_masks", "tensorpar.random",
     "tensorpar.checkpoint_without_output"),
    ("tensorpar.grads",),
    ("tensorpar.fsdp_mesh", "tensorpar.fsdp", "tensorpar.invariant", "tensorpar.invariant_dropout"),
    ("tensorpar.context",),
    ("tensorpar.comm_model", "tensorpar.memory_model", "tensorpar.fsdp_model"),
    ("tensorpar.models",),
    ("tensorpar.pipeline",),
    ("tensorpar", "tensorpar._public"),
    ("tensorpar.training",),
    ("tensorpar.tools", "tensorpar.cli", "tensorpar.gpu_check", "tensorpar.__main__"),
)
SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every tensorpar module ``path`` imports, at module level or inside a function."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)
    return {m for m in found if m in modules and m != name}


def _layer(module: str) -> int:
    matches = [(len(prefix), index) for index, layer in enumerate(LAYERS) for prefix in layer
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer of LAYERS (nor of docs/architecture.md's table): place it"
    return max(matches)[1]


def test_modules_import_only_from_their_own_layer_or_below_and_never_in_a_cycle():
    paths = sorted(SRC.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, "imports from a lower layer to a higher one: " + "; ".join(upward)
    done, stack = set(), []

    def visit(module):
        if module in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(module):] + [module]))
        if module not in done:
            stack.append(module)
            for dep in sorted(graph[module]):
                visit(dep)
            stack.pop()
            done.add(module)

    for module in sorted(graph):
        visit(module)


def test_no_module_of_the_package_is_over_500_lines():
    long = {_module_name(p): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
