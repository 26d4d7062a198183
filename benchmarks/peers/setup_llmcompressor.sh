#!/usr/bin/env bash
# Create the isolated virtual environment for the llm-compressor peer runner
# (benchmarks/peers/llmcompressor_quantize.py). llm-compressor is only a
# benchmark peer: it is never an llmq dependency and never installed into the
# llmq environment.
#
# Idempotent: does nothing when the venv already imports llmcompressor at the
# pinned version. Exits non-zero on any failure.
#
# Usage: bash benchmarks/peers/setup_llmcompressor.sh
#   env PYTHON=python3.11   interpreter used to create the venv (default: python3)
#   env LLMC_VENV=DIR       venv location (default: benchmarks/.venvs/llmcompressor)
set -euo pipefail

# Versions found to work together on CPU-only torch 2.13 (see README.md).
TORCH_VERSION="2.13.0"
LLMCOMPRESSOR_VERSION="0.14.0.1"
COMPRESSED_TENSORS_VERSION="0.19.0"
TRANSFORMERS_VERSION="5.17.0"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bench_dir="$(dirname "$here")"
venv="${LLMC_VENV:-$bench_dir/.venvs/llmcompressor}"
python="${PYTHON:-python3}"
vpy="$venv/bin/python"

log() { echo "[setup_llmcompressor] $*" >&2; }

check() {
    # Importable at the pinned versions?
    [ -x "$vpy" ] || return 1
    HF_HUB_OFFLINE=1 "$vpy" - "$LLMCOMPRESSOR_VERSION" "$COMPRESSED_TENSORS_VERSION" \
        "$TRANSFORMERS_VERSION" "$TORCH_VERSION" >/dev/null 2>&1 <<'EOF'
import sys
from importlib.metadata import version
want = dict(zip(["llmcompressor", "compressed-tensors", "transformers", "torch"], sys.argv[1:]))
for pkg, ver in want.items():
    have = version(pkg)
    if have.split("+")[0] != ver:
        raise SystemExit(f"{pkg} {have} != {ver}")
import llmcompressor  # noqa: F401  (the real import check)
from llmcompressor import oneshot  # noqa: F401
EOF
}

if check; then
    log "ok: $venv already has llmcompressor==$LLMCOMPRESSOR_VERSION"
    exit 0
fi

if [ ! -x "$vpy" ]; then
    log "creating venv $venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_q() {
    # quiet pip; drop the noise about absent local index folders, keep real errors
    local err rc=0
    err="$(mktemp)"
    "$vpy" -m pip install --quiet "$@" 2>"$err" || rc=$?
    grep -v "^WARNING: Location 'file:" "$err" >&2 || true
    rm -f "$err"
    return "$rc"
}

# torch first, pinned: a bare torch requirement would resolve to the CUDA
# build and pull gigabytes of nvidia-* wheels; with torch==2.13.0 already
# installed pip keeps it (llmcompressor accepts torch>=2.10,<=2.14.0).
log "installing torch==$TORCH_VERSION"
pip_q "torch==$TORCH_VERSION"
log "installing llmcompressor==$LLMCOMPRESSOR_VERSION compressed-tensors==$COMPRESSED_TENSORS_VERSION transformers==$TRANSFORMERS_VERSION"
pip_q "torch==$TORCH_VERSION" \
    "llmcompressor==$LLMCOMPRESSOR_VERSION" \
    "compressed-tensors==$COMPRESSED_TENSORS_VERSION" \
    "transformers==$TRANSFORMERS_VERSION" \
    "safetensors" "datasets"

if ! check; then
    log "FAILED: llmcompressor not importable at the pinned versions in $venv"
    HF_HUB_OFFLINE=1 "$vpy" -c "import llmcompressor" >&2 || true
    exit 1
fi
log "ok: $venv ready (llmcompressor==$LLMCOMPRESSOR_VERSION)"
