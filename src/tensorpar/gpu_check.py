"""Deprecated since 0.4: the GPU check is :mod:`tensorpar.tools.gpu_check`.

Keeps ``python -m tensorpar.gpu_check`` working meanwhile.
"""

import sys
import warnings

from .tools.gpu_check import main

__all__ = ["main"]

_MOVED = "tensorpar.gpu_check is deprecated: run `python -m tensorpar.tools.gpu_check`"
warnings.warn(_MOVED, DeprecationWarning, stacklevel=2)

if __name__ == "__main__":  # run as a script, where DeprecationWarning is not shown
    print(_MOVED, file=sys.stderr)
    sys.exit(main())
