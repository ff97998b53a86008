"""The package itself: ``import tensorpar`` loads the library and nothing of the launcher or the CLI."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER_SIDE = ("torch.distributed.elastic", "tensorpar.cli", "tensorpar.training")


@pytest.mark.slow
def test_import_tensorpar_loads_no_launcher_elastic_or_cli_module():
    code = ("import sys, tensorpar, tensorpar.errors, tensorpar.models; "
            f"print(sorted(m for m in sys.modules if m.startswith({LAUNCHER_SIDE!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_errors_keeps_the_names_the_library_and_commands_use():
    from tensorpar.errors import UsageError, check_index_range  # noqa: F401
    from tensorpar.cli.errors import exit_code, one_line, report  # noqa: F401
    from tensorpar.cli.launch import OneLineErrorHandler  # noqa: F401

    assert exit_code(UsageError("--tp 3")) == 2 and one_line(UsageError("a\nb")) == "a b"


# The floors of DESIGN.md (and of docs/architecture.md's picture), lowest first: a module imports
# only from its own floor or the ones below it. A module is placed by its longest prefix here.
LAYERS = (
    ("tensorpar.errors", "tensorpar.porting"),
    ("tensorpar.distributed",),
    ("tensorpar.parallel_state",),
    ("tensorpar.tensor_parallel",),
    ("tensorpar.data_parallel", "tensorpar.context_parallel", "tensorpar.expert_parallel"),
    ("tensorpar.invariant",),
    ("tensorpar.models",),
    ("tensorpar.pipeline_parallel",),
    ("tensorpar.planning",),
    ("tensorpar", "tensorpar._public", "tensorpar.training"),
    ("tensorpar.cli", "tensorpar.__main__"),
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
