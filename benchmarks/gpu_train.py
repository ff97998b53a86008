"""tensorpar's GPT against the same model in plain PyTorch, trained on one GPU in one run (see
:mod:`tensorpar.cli.gpu_train_bench`)::

    python benchmarks/gpu_train.py --model gpt2-small --micro-batch 16
    python benchmarks/gpu_train.py --model llama-1b --micro-batch 4
"""

from tensorpar.cli.gpu_train_bench import main

if __name__ == "__main__":
    main()
