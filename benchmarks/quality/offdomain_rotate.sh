#!/bin/bash
# Issue 21: SmolLM2-135M fp8-kv8 (FP8 static W8A8 + FP8 KV), fp8ptq default vs --rotate, scored in-domain
# (built-in evaluation split) and off-domain (Debian's licence texts, /usr/share/common-licenses: legal
# prose, never used for calibration) by the same evaluator. One run at a time.
#   bash benchmarks/quality/offdomain_rotate.sh [CALIB_SAMPLES=16] [EVAL_SAMPLES=16] [WORK=/tmp/i21]
set -euo pipefail
CAL=${1:-16}; EV=${2:-16}; WORK=${3:-/tmp/i21}
mkdir -p "$WORK"
OFF="$WORK/licences.txt"  # every licence text once (symlinks skipped), blank-line separated
for f in /usr/share/common-licenses/*; do [ -L "$f" ] || { cat "$f"; printf "\n\n"; }; done > "$OFF"
export HF_HUB_OFFLINE=1
PY=".venv/bin/python -m fp8ptq"
for v in default rotate; do
  extra=""; [ "$v" = rotate ] && extra="--rotate"
  nice -n 5 $PY quantize smollm2-135m -r fp8-kv8 -o "$WORK/q-$v" --overwrite --eval-samples 0 --json \
    --num-samples "$CAL" --seq-len 512 --no-recipe-gates $extra > "$WORK/q-$v.json"
done
for v in default rotate; do
  nice -n 5 $PY eval quality "$WORK/q-$v" --reference smollm2-135m --num-samples "$EV" --seq-len 512 \
    --eval-data "$OFF" --json --no-record > "$WORK/e-$v.json"
done
.venv/bin/python - "$WORK" <<'PY'
import json, sys
for v in ("default", "rotate"):
    r = json.load(open(f"{sys.argv[1]}/e-{v}.json"))
    q = json.load(open(f"{sys.argv[1]}/q-{v}.json"))
    cells = [f"{d['kl']:.5f} | {d['top1'] * 100:.2f}% | {d['ppl']:.3f} ({d['ppl_reference']:.3f})" for d in (r, r["off_domain"])]
    print(f"| fp8ptq {v} | {q['timings']['quantize_s']:.0f} | {q['size_bytes']['output'] / 2**20:.1f} | " + " | ".join(cells) + " |")
PY
