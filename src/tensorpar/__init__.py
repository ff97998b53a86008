"""tensorpar: Megatron-style tensor parallelism for PyTorch, on any device.

The public names (``tp.ColumnParallelLinear``, ``tp.GPT``, ...) load on first use, with torch:
``import tensorpar`` alone imports neither, so that the ``tensorpar`` command answers ``--help``
and a mistyped flag at once.
"""

import importlib
import importlib.metadata
import importlib.util
import re
import sys

__version__ = "0.5.0"


def _torch_version() -> str:
    """The torch this process uses: the imported one, else the installed one's metadata."""
    if "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a torch built in place has no metadata
        import torch

        return str(torch.__version__)


# Checkpoint loading reads tensor data through torch.load(weights_only=True) (DCP), which can
# run code from a crafted file before torch 2.6 (CVE-2025-32434).
_version = _torch_version()
if tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", _version).groups()) < (2, 6):
    raise ImportError(f"tensorpar needs torch >= 2.6 (older torch.load can run code from a checkpoint file, "
                      f"CVE-2025-32434); this is torch {_version}: pip install 'torch>=2.6'")


def _load_public_names() -> None:
    from . import _public

    globals().update({name: value for name, value in vars(_public).items() if not name.startswith("_")})


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(f"module 'tensorpar' has no attribute {name!r}")
    # A submodule alone (`from .. import comm` inside the library, `tensorpar.distributed.comm`): loading
    # every public name here would import the module that is asking, half initialized.
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    _load_public_names()
    if name in globals():
        return globals()[name]
    raise AttributeError(f"module 'tensorpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    _load_public_names()
    return sorted(globals())
