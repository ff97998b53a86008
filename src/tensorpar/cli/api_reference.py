"""Write docs/api.md from the docstrings: every public name of ``tensorpar`` and its subpackages.

Run ``python -m tensorpar.cli.api_reference > docs/api.md`` after changing a public name or
its docstring; ``tests/test_docs.py`` checks that the page is current.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys

# The packages whose public names are the API, in the order the page lists them, and the module
# that defines each one's names (``tensorpar`` loads its own from ``tensorpar._public`` on first use).
PACKAGES = {"tensorpar": "tensorpar._public", "tensorpar.models": "tensorpar.models",
            "tensorpar.pipeline_parallel": "tensorpar.pipeline_parallel",
            "tensorpar.context_parallel": "tensorpar.context_parallel"}


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name, value in vars(module).items()
                 if not name.startswith("_") and not inspect.ismodule(value)]
    return sorted(names, key=str.lower)


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else "(no docstring)"


def _methods(cls) -> list[tuple[str, object]]:
    """The public methods a class defines itself (not those it inherits from torch)."""
    return [(name, value) for name, value in vars(cls).items()
            if not name.startswith("_") and callable(value) and value.__doc__]


def _entry(qualified: str, obj) -> list[str]:
    if inspect.isclass(obj):
        lines = [f"### class `{qualified}{_signature(obj)}`", "", _doc(obj), ""]
        for name, method in _methods(obj):
            lines += [f"- `{name}{_signature(method)}`: {_doc(method).splitlines()[0]}"]
        return lines + ([""] if _methods(obj) else [])
    if callable(obj):
        return [f"### `{qualified}{_signature(obj)}`", "", _doc(obj), ""]
    return [f"### `{qualified}` = `{obj!r}`", ""]


def reference() -> str:
    """The markdown of docs/api.md."""
    lines = ["# API reference", "",
             "Generated from the docstrings by `python -m tensorpar.cli.api_reference`; "
             "do not edit by hand.", ""]
    for package, source in PACKAGES.items():
        module = importlib.import_module(source)
        lines += [f"## `{package}`", "", _doc(importlib.import_module(package)).splitlines()[0], ""]
        for name in _public_names(module):
            obj = getattr(module, name)
            if package != "tensorpar" and getattr(importlib.import_module("tensorpar"), name, None) is obj:
                continue  # listed once, under tensorpar
            lines += _entry(f"{package}.{name}", obj)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    sys.stdout.write(reference())


if __name__ == "__main__":
    main()
