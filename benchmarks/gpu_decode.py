"""Decoding at batch 1 on one GPU against the weight-streaming floor, tensorpar eager, with its
CUDA graph, and transformers' static cache (see :mod:`tensorpar.cli.gpu_decode_bench`)::

    python benchmarks/gpu_decode.py --model llama3-8b --new-tokens 128
"""

from tensorpar.cli.gpu_decode_bench import main

if __name__ == "__main__":
    main()
