"""Deprecated since 0.4: the ``tensorpar`` command's entry is :mod:`tensorpar.tools.cli`.

``python -m tensorpar`` (or the ``tensorpar`` script) runs the command; this module keeps
``python -m tensorpar.cli`` and ``from tensorpar.cli import main`` working meanwhile.
"""

import sys
import warnings

from .tools.cli import build_parser, main

__all__ = ["build_parser", "main"]

_MOVED = "tensorpar.cli is deprecated: use tensorpar.tools.cli, or run `python -m tensorpar`"
warnings.warn(_MOVED, DeprecationWarning, stacklevel=2)

if __name__ == "__main__":  # run as a script, where DeprecationWarning is not shown
    print(_MOVED, file=sys.stderr)
    sys.exit(main())
