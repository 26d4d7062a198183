#!/usr/bin/env bash
# The prepared call on a lent GPU for GPU calibration at scale (the big-checkpoints issue, item 4):
# GPTQ W4A16 g128 of a Llama-3-8B-shaped checkpoint (random weights, LAYERS decoder layers),
# SAMPLES x SEQ_LEN calibration tokens, llmq and llm-compressor 0.14 side by side
# (benchmarks/bench_gpu_calibration.py: llmq, the peer, llmq with --stage-activations recompute and
# llmq with --no-tf32; ROWS picks some), after GPTQ's column loop alone at two of its linears'
# shapes, Triton kernel against torch ops (benchmarks/bench_gptq_loop.py).
# Carried paths: .whl (what the GPU image lacks: compressed-tensors 0.19.0, llmcompressor 0.14.0.1,
# pydantic, datasets, gguf, ...), .gpu/calib.txt (the calibration text, shakespeare + pydoc) and
# .gpu/tokenizer (SmolLM2's: the random model needs a tokenizer, and its ids fit any vocabulary).
# Everything lands in $OUT (the device tool's folder; benchmarks/out/gpu-calibration by hand).
#   LAYERS=8 LIMIT=170 [ROWS="llmq llm-compressor"] bash benchmarks/gpu_calibration.sh
set -u
OUT=${OUT:-benchmarks/out/gpu-calibration}
ARCH=${ARCH:-llama3-8b} LAYERS=${LAYERS:-32} SAMPLES=${SAMPLES:-128} SEQ_LEN=${SEQ_LEN:-2048} LIMIT=${LIMIT:-240}
DEVICE=${DEVICE:-cuda} PYTHON=${PYTHON:-python3} PEER_PYTHON=${PEER_PYTHON:-$PYTHON}
LOOP_SHAPES=${LOOP_SHAPES:-6144x4096 4096x14336}
WORK=${WORK:-/tmp/gpu-calibration} ROWS=${ROWS:-llmq llm-compressor llmq-recompute llmq-fp32}
mkdir -p "$OUT"
LOG=$OUT/session.log
export PYTHONUNBUFFERED=1
if [ -d "${WHEELS:-.whl}" ]; then  # WHEELS=none on a machine that has the packages
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${WHEELS:-.whl}"/*.whl >>"$LOG" 2>&1 || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
stage() { echo "== $1 ($(date +%T))" | tee -a "$LOG"; }

stage environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PYTHON -c "import torch, transformers, compressed_tensors, datasets, pyarrow
from importlib.metadata import version
print('torch', torch.__version__, 'transformers', transformers.__version__,
      'compressed-tensors', compressed_tensors.__version__, 'datasets', datasets.__version__,
      'pyarrow', pyarrow.__version__, 'cuda', torch.cuda.is_available())
print('llmcompressor', version('llmcompressor'))"
  nproc; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee -a "$LOG"

stage "GPTQ's column loop: Triton kernel against torch ops"
timeout 150 $PYTHON benchmarks/bench_gptq_loop.py --shapes $LOOP_SHAPES 2>&1 | tee -a "$LOG" "$OUT/gptq-loop.jsonl"

stage "random $ARCH-shaped checkpoint, $LAYERS layers"
rm -rf "$WORK" && mkdir -p "$WORK"
timeout 180 $PYTHON benchmarks/random_model.py "$WORK/model" --arch "$ARCH" --layers "$LAYERS" \
  --tokenizer .gpu/tokenizer --device "$DEVICE" 2>&1 | tail -1 | tee -a "$LOG"
du -sh "$WORK/model" | tee -a "$LOG"

stage "GPTQ W4A16 g128, $SAMPLES x $SEQ_LEN tokens: $ROWS"
$PYTHON benchmarks/bench_gpu_calibration.py --model "$WORK/model" --calib-text .gpu/calib.txt \
  --out "$WORK/bench" --samples "$SAMPLES" --seq-len "$SEQ_LEN" --device "$DEVICE" \
  --timeout "$LIMIT" --peer-python "$PEER_PYTHON" --only $ROWS 2>&1 | grep -v "examples/s" | tee -a "$LOG"
cp "$WORK"/bench/report.json "$WORK"/bench/*.log "$OUT"/ 2>/dev/null
stage done
