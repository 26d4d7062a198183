#!/usr/bin/env bash
# The one prepared call on a lent GPU (issue 38): `llmq bench` end to end and a profile of
# batch-1 decode (eager, and replayed from a CUDA graph) first, then tune the Triton kernels,
# time every kernel against torch and its quantized paths with the tuned table, and the
# remaining end-to-end runs. About 6 minutes on an H100; copy $OUT/nvidia-*.json to
# llmq/kernels/tuned/ to ship the table. At most 7 files land in $OUT (the device tool returns 8).
# Each stage has its own time limit, so a slow one cannot eat the rest; everything lands in $OUT
# (the device tool's folder; benchmarks/out/gpu when run by hand).
#   bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
LOG=$OUT/session.log
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # the packages the GPU image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
LLMQ="python3 -m llmq.cli.main"
stage() { echo "== $1 ($(date +%T))" | tee -a "$LOG"; }

stage environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee -a "$LOG"

e2e() {  # name arch-args scheme-args...: a random checkpoint, quantized, timed end to end
  local name=$1 arch=$2; shift 2
  [ -d /tmp/$arch ] || timeout 60 python3 benchmarks/random_model.py /tmp/$arch --arch $arch \
    ${LAYERS:+--layers $LAYERS} >>"$LOG" 2>&1
  timeout 60 $LLMQ quantize /tmp/$arch --method rtn --skip-layer-check --no-reference \
    --out /tmp/$name "$@" >>"$LOG" 2>&1
  timeout 60 $LLMQ bench /tmp/$name --json >"$OUT/e2e-$name.json" 2>>"$LOG"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['end_to_end']; print(sys.argv[1], d)" \
    "$OUT/e2e-$name.json" 2>&1 | tee -a "$LOG"
}
profile() {  # checkpoint: where its batch-1 decode spends the time, against the dense twin
  timeout 60 python3 benchmarks/profile_decode.py "$1" 2>&1 | tee -a "$LOG"
}

stage "end to end: the default model's architecture (random weights), W4A16, built-in rule"
e2e smol-w4a16 smollm2-135m --scheme w4a16 --group-size 64
stage "profile batch-1 decode (the quantized model's gap to dense)"
profile /tmp/smol-w4a16

stage tune
timeout 170 python3 benchmarks/tune_kernels.py --trials 3 --out "$OUT" 2>&1 | tee -a "$LOG"
TABLE=$(ls "$OUT"/nvidia*.json 2>/dev/null | head -1)
[ -n "$TABLE" ] && export LLMQ_KERNEL_TUNING=$TABLE

stage "bench kernels (table: ${TABLE:-none})"
timeout 100 python3 benchmarks/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee -a "$LOG"

stage "end to end: Llama-3-8B layer shapes, 2 layers (random weights), W4A16"
LAYERS=2 e2e l8b-w4a16 llama3-8b --scheme w4a16
profile /tmp/l8b-w4a16
stage "end to end: the default model's architecture, W8A8"
e2e smol-w8a8 smollm2-135m --scheme w8a8
stage done
