#!/usr/bin/env bash
# Idempotent setup of a dedicated venv for llm-compressor benchmarks.
# Usage: bash benchmarks/setup_llmc_venv.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${LLMC_VENV:-$HERE/.venv-llmc}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
TORCH_VER="2.13.0"
LLMC_VER="0.14.0.1"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llmcompressor" >/dev/null 2>&1; then
    echo "llm-compressor venv already ready at $VENV"
    "$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|compressed-tensors|llmcompressor) ' || true
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
# torch first (pinned: an unpinned torch would pull multi-GB CUDA wheels)
"$VENV/bin/python" -m pip install "torch==$TORCH_VER"
# keep torch pinned on the same command line so pip cannot replace it
"$VENV/bin/python" -m pip install "llmcompressor==$LLMC_VER" "torch==$TORCH_VER"
"$VENV/bin/python" -c "import llmcompressor, torch; print('llmcompressor', llmcompressor.__version__, 'torch', torch.__version__)"
