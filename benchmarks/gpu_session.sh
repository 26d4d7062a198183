#!/usr/bin/env bash
# The one prepared call on a lent GPU (issue 38): tune the Triton kernels, time every kernel
# against torch and its quantized paths with the tuned table, then `llmq bench` end to end.
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
llmq() { python3 -m llmq.cli.main "$@"; }
stage() { echo "== $1 ($(date +%T))" | tee -a "$LOG"; }

stage environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee -a "$LOG"

stage tune
timeout 220 python3 benchmarks/tune_kernels.py --out "$OUT" 2>&1 | tee -a "$LOG"
TABLE=$(ls "$OUT"/nvidia*.json 2>/dev/null | head -1)
[ -n "$TABLE" ] && export LLMQ_KERNEL_TUNING=$TABLE

stage "bench kernels (table: ${TABLE:-none})"
timeout 160 python3 benchmarks/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee -a "$LOG"

stage "end to end: the default model's architecture (random weights)"
python3 benchmarks/random_model.py /tmp/smol >>"$LOG" 2>&1
for scheme in w4a16 w8a8; do
  timeout 60 llmq quantize /tmp/smol --scheme $scheme --group-size 64 --method rtn \
    --skip-layer-check --no-reference --out /tmp/smol-$scheme >>"$LOG" 2>&1
  timeout 60 llmq bench /tmp/smol-$scheme --json >"$OUT/e2e-smol-$scheme.json" 2>>"$LOG"
  tail -c 400 "$OUT/e2e-smol-$scheme.json" | tee -a "$LOG"
done

stage "end to end: Llama-3-8B layer shapes, 4 layers (random weights)"
timeout 60 python3 benchmarks/random_model.py /tmp/l8b --arch llama3-8b --layers 4 >>"$LOG" 2>&1
timeout 60 llmq quantize /tmp/l8b --scheme w4a16 --method rtn --skip-layer-check --no-reference \
  --out /tmp/l8b-w4a16 >>"$LOG" 2>&1
timeout 60 llmq bench /tmp/l8b-w4a16 --batch 1,16 --json >"$OUT/e2e-l8b-w4a16.json" 2>>"$LOG"
tail -c 400 "$OUT/e2e-l8b-w4a16.json" | tee -a "$LOG"
stage done
