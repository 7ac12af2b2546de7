#!/usr/bin/env bash
# Idempotent setup of a dedicated venv for the auto-round peer benchmark (issue 37):
#   bash benchmarks/setup_autoround_venv.sh      # then benchmarks/quality/autoround_quantize.py runs in it
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${AUTOROUND_VENV:-$HERE/.venv-autoround}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
TORCH_VER="2.13.0"
AR_VER="0.16.1"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import auto_round" >/dev/null 2>&1; then
    echo "auto-round venv already ready at $VENV"
    "$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|auto-round|auto_round) ' || true
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
# torch first (pinned: an unpinned torch would pull multi-GB CUDA wheels), and pinned again beside auto-round
"$VENV/bin/python" -m pip install "torch==$TORCH_VER"
"$VENV/bin/python" -m pip install "auto-round==$AR_VER" "torch==$TORCH_VER"
"$VENV/bin/python" -c "import auto_round, torch; print('auto-round', auto_round.__version__, 'torch', torch.__version__)"
