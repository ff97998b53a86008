"""MLP block forward+backward, tensorpar vs PyTorch DTensor TP: same flags as ``tensorpar bench``.

    python benchmarks/mlp_vs_dtensor.py --tp 2 --seq 256 --batch 4 --hidden 512 --rounds 7
"""

import sys

from tensorpar.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
