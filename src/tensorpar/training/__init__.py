"""Training a tensor- and data-parallel GPT: data, loop, checkpoints, progress, the commands."""
