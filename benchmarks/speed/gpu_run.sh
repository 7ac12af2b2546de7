#!/usr/bin/env bash
# One device call for issue 35 (../shared/gpu/README.md): run from the project root on a lent GPU machine,
# carrying .gpu (bash ../shared/gpu/prepare.sh). Results land in $OUT (default /tmp/gpu-out):
#   gpu.txt                      the card, torch and Triton versions, the commit (COMMIT_ID: the device copy
#                                has the working tree, not the history), each step's exit status
#   gptq_kernel.json             benchmarks/speed/gptq_kernel_bench.py: the GPTQ solve alone on Llama-3-8B shapes
#                                (KERNEL_S=0 skips it; KERNEL_GRIDS=a,b picks grids, e.g. the FP4 and lazy-group
#                                ones: nvfp4-actorder,mxfp4-actorder,int4-g128-lazy)
#   gpu_profile-<L>l-<w>-<d>.json benchmarks/speed/gpu_profile.py, one per word of PROFILES ("weights:dtype[:layers]"):
#                                host regions and device kernels of one fp8ptq run (before the STEPS)
#   gpu_bench-<L>l-<plan>.json   benchmarks/speed/gpu_bench.py, one file per step of STEPS ("layers:plan[:repeats]"
#                                words, plan = indices into gpu_bench.PLAN; repeats default REPEATS),
#                                alternating repeats, medians
# Every step stops at the shared deadline (TOTAL_S from the start); gpu_bench writes each row as it finishes,
# so a step cut short keeps the rows and repeats it has.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${TOTAL_S:-560}))
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu BENCH_ARGS="--hidden 64 ..." SKIP_ENV=1: a dry run of the script on a CPU
[ -n "${SKIP_ENV:-}" ] || source .gpu/env.sh || exit 1
LLMC_PY=${LLMC_PY:-$(command -v python3)}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"
  python3 -c "import triton; print('triton', triton.__version__)"
  echo "commit ${COMMIT_ID:-$(git rev-parse HEAD 2>/dev/null)}"; nproc; } > "$OUT/gpu.txt" 2>&1
if [ "${KERNEL_S:-150}" != 0 ]; then
  timeout "${KERNEL_S:-150}" python3 benchmarks/speed/gptq_kernel_bench.py --device cuda --sweep 16x2,32x4,64x4,64x8,128x8 \
    ${KERNEL_GRIDS:+--grids "$KERNEL_GRIDS"} --json "$OUT/gptq_kernel.json" > "$OUT/gptq_kernel.log" 2>&1
  echo "gptq_kernel_bench rc=$?" >> "$OUT/gpu.txt"
fi
for prof in ${PROFILES:-}; do  # "weights:dtype[:layers]" words: benchmarks/speed/gpu_profile.py, where the time goes
  IFS=: read -r weights dtype players <<< "$prof"
  name="gpu_profile-${players:-4}l-$weights-$dtype"
  left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 30 ]; then echo "$name skipped: ${left}s left" >> "$OUT/gpu.txt"; continue; fi
  # shellcheck disable=SC2086  # PROFILE_ARGS: several words
  timeout "$left" python3 benchmarks/speed/gpu_profile.py --device "$DEVICE" --layers "${players:-4}" --weights "$weights" \
    --compute-dtype "$dtype" ${PROFILE_ARGS:-} --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at ${SECONDS}s" >> "$OUT/gpu.txt"
done
for step in ${STEPS:-4:}; do
  IFS=: read -r layers plan repeats <<< "$step"
  name="gpu_bench-${layers}l-${plan//,/-}"
  left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 30 ]; then echo "$name skipped: ${left}s left" >> "$OUT/gpu.txt"; continue; fi
  # shellcheck disable=SC2086  # BENCH_ARGS: several words
  timeout "$left" python3 benchmarks/speed/gpu_bench.py --device "$DEVICE" --layers "$layers" --plan "$plan" \
    --repeats "${repeats:-${REPEATS:-1}}" --eval-samples "${EVAL_SAMPLES:-2}" --llmc-python "$LLMC_PY" \
    ${BENCH_ARGS:-} --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at ${SECONDS}s" >> "$OUT/gpu.txt"
done
cat "$OUT/gpu.txt"; for f in "$OUT"/*.log; do echo "== $f"; tail -n 8 "$f"; done
