"""``python -m tensorpar``: the ``tensorpar`` command."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
