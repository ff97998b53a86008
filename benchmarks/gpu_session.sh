#!/usr/bin/env bash
# A lent GPU's checks in one call of about 5 minutes, run from the repository root: the GPU's name,
# the GPU check (at most 90 s), then `tensorpar bench --gpu` (training GPT-2 small and a
# Llama-3.2-1B shape two ways, eager and compiled; decoding a Llama-3-8B shape against its floor),
# and an MoE layer's step with grouped GEMM against the loop over experts.
# What it prints is also written under $OUT (default: ./gpu-session).
set -o pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-gpu-session}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" 2>&1 | tee -a "$out/gpu.txt"
timeout 90 python3 -m tensorpar.cli.gpu_check 2>&1 | tee "$out/gpu_check.txt"
timeout 210 python3 -m tensorpar bench --gpu 2>&1 | tee "$out/bench.txt"
timeout 60 python3 benchmarks/moe_step.py --device cuda --ranks 1 --tokens 8192 --hidden 1024 --ffn 2048 --experts 8 2>&1 | tee "$out/moe.txt"
