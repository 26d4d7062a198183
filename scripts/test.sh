#!/usr/bin/env bash
# Set up llmq and run the tests on two pytest-xdist workers (docs/tests.md). Extra arguments go
# to pytest (-n 0: one process, e.g. to debug with pdb).
#   bash scripts/test.sh           the whole suite: the command CI runs
#   bash scripts/test.sh --fast    the inner loop: no real processes, no real default model, no
#                                  Triton interpreter, nothing slow
set -euo pipefail
cd "$(dirname "$0")/.."
args=(-n 2)
if [ "${1:-}" = "--fast" ]; then
    shift
    args+=(-m "not slow and not integration and not process and not interpreter")
fi
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${LLMQ_VENV:-.venv}/bin/activate"
# llama.cpp, when benchmarks/peers/setup_llamacpp.sh has built it here: the GGUF tests that run it
# (`llmq verify --loader llama.cpp`) are skipped without it
llama_cpp=benchmarks/.venvs/llamacpp/llama.cpp/build/bin
if [ -z "${LLMQ_LLAMA_CPP:-}" ] && [ -x "$llama_cpp/llama-perplexity" ]; then
    export LLMQ_LLAMA_CPP="$PWD/$llama_cpp"
fi
python -m pytest "${args[@]}" "$@"
