#!/usr/bin/env bash
# Set up llmq and run the whole test suite (the command CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${LLMQ_VENV:-.venv}/bin/activate"
python -m pytest "$@"
