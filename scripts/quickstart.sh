#!/usr/bin/env bash
# The main job on the embedded default model: quantize SmolLM2-135M with calibrated methods
# (GPTQ W4A16 g64, SmoothQuant + GPTQ W8A8; 32 calibration windows of 512 tokens to stay within
# a few minutes on 2 CPU cores), evaluate both against the float model on held-out news, gate
# them on task accuracy, and run the W4A16 checkpoint on llmq's kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${LLMQ_VENV:-.venv}/bin/activate"
mkdir -p runs
llmq quantize smollm2-135m --out runs/smollm2-135m-w4a16-gptq --scheme w4a16 --group-size 64 \
    --method gptq --num-samples 32 --overwrite
llmq quantize smollm2-135m --out runs/smollm2-135m-w8a8-gptq --scheme w8a8 --method gptq \
    --smooth auto --num-samples 32 --overwrite
llmq eval runs/smollm2-135m-w4a16-gptq runs/smollm2-135m-w8a8-gptq --baseline smollm2-135m \
    --eval-windows 16
# A task-accuracy gate: exit 1 if next-line accuracy drops more than 5 points, significantly.
llmq eval runs/smollm2-135m-w4a16-gptq runs/smollm2-135m-w8a8-gptq --baseline smollm2-135m \
    --tasks hamlet_next_line --limit 100 --max-drop 0.05
# Run the W4A16 checkpoint on llmq's kernels (Triton on a GPU, their torch reference on the CPU).
llmq generate runs/smollm2-135m-w4a16-gptq --prompt "The capital of France is" --max-new-tokens 16
