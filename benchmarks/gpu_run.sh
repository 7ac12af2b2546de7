#!/usr/bin/env bash
# The one device call for issue 35 (../shared/gpu/README.md): run from the project root on a lent GPU
# machine, carrying .gpu (bash ../shared/gpu/prepare.sh). Results land in $OUT (default /tmp/gpu-out):
#   gpu.txt             the card, torch and Triton versions, the commit
#   gptq_kernel.json    benchmarks/gptq_kernel_bench.py: the GPTQ solve alone on Llama-3-8B shapes
#   gpu_bench.json      benchmarks/gpu_bench.py: 4 layers at 8B width, fp8ptq vs llm-compressor
# Each step has its own time limit, so one that runs long still leaves the others' results.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
source .gpu/env.sh || exit 1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null || true; nproc; } > "$OUT/gpu.txt" 2>&1
timeout "${KERNEL_S:-150}" python3 benchmarks/gptq_kernel_bench.py --device cuda --sweep 16x2,32x4,64x4,64x8,128x8 \
  --json "$OUT/gptq_kernel.json" > "$OUT/gptq_kernel.log" 2>&1
echo "gptq_kernel_bench rc=$?" >> "$OUT/gpu.txt"
timeout "${BENCH_S:-380}" python3 benchmarks/gpu_bench.py --device cuda --layers "${LAYERS:-4}" --eval-samples 2 \
  --llmc-python "$(command -v python3)" --json "$OUT/gpu_bench.json" > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench rc=$?" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"; tail -n 12 "$OUT/gptq_kernel.log" "$OUT/gpu_bench.log"
