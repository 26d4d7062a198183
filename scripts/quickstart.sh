#!/usr/bin/env bash
# The main job on the embedded default model: quantize SmolLM2-135M to W4A16 and W8A8, then
# evaluate both against the float model on held-out news text, printing one table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${LLMQ_VENV:-.venv}/bin/activate"
mkdir -p runs
llmq quantize smollm2-135m --out runs/smollm2-135m-w4a16 --scheme w4a16 --overwrite
llmq quantize smollm2-135m --out runs/smollm2-135m-w8a8 --scheme w8a8 --overwrite
llmq eval runs/smollm2-135m-w4a16 runs/smollm2-135m-w8a8 --baseline smollm2-135m --max-windows 16
# Run the W4A16 checkpoint on llmq's kernels (Triton on a GPU, their torch reference on the CPU).
llmq generate runs/smollm2-135m-w4a16 --prompt "The capital of France is" --max-new-tokens 16
